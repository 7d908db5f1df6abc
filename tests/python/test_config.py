"""Configuration files (gw.configfile, gridweave train --config / --print-config / --dry-run):
sections onto TrainConfig's fields, flags over the file, one clear error for a bad key or type,
the example configs, and the resolved config in the run folder."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import gridweave as gw
from gridweave import cli, config, configfile, plan
from gridweave.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "configs" / "main_job.toml"
LLAMA_7B = ROOT / "configs" / "llama-7b-gpu.toml"


def _cli(*args, timeout=300, port=29650):
    return subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)})


def test_every_field_is_in_exactly_one_section():
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.init]
    placed = [k for keys in configfile.SECTIONS.values() for k in keys]
    assert sorted(placed) == sorted(fields)


def test_one_declaration_gives_flag_key_and_reference(docs_hooks):
    """Each section's field is a flag (its default the field's), a key of its TOML table and a row
    of the generated reference; the command line with no flags is TrainConfig's defaults."""
    import argparse

    parser = cli._train_parser(argparse.ArgumentParser().add_subparsers())
    flags = {o: a for a in parser._actions for o in a.option_strings}
    reference = docs_hooks.config_reference()
    for section in config.SECTIONS:
        assert tuple(configfile.TABLES[section.NAME]) == section.names() and f"### [{section.NAME}]" in reference
        for f in section.declared():
            action = flags["--" + f.name.replace("_", "-")]
            assert action.dest == f.name and f"| `{f.name}` |" in reference
            assert action.default == (f.metadata["cli"] or {}).get("default", f.default), f.name
    assert cli.parse_train([]) == TrainConfig()
    assert cli.parse_train(["--no-offload", "--sync-save", "--no-overlap-grad-reduce"]) == \
        TrainConfig(offload=False, async_save=False, overlap_grad_reduce=False)


@pytest.mark.parametrize("section, kw, needle", [
    (config.OptimizerSection, dict(lr=-1.0), "lr must be a finite positive number"),
    (config.OptimizerSection, dict(min_lr=1.0), "min_lr must be in [0, lr=0.003]"),
    (config.ModelSection, dict(attention="linformer"), "attention=linformer and linformer_k go together"),
    (config.ModelSection, dict(precision="fp4"), "precision must be one of"),
    (config.ParallelismSection, dict(chunks=2), "chunks=2 needs schedule=interleaved"),
    (config.ParallelismSection, dict(zero_shard_group="node"), "it needs zero 1, 2 or 3"),
    (config.MoESection, dict(experts=0), "experts must be a positive integer"),
    (config.TrainingSection, dict(ac="sometimes"), "ac must be 'none', 'auto' or a positive integer"),
    (config.DataSection, dict(vocab=0), "vocab must be a positive integer"),
    (config.CheckpointSection, dict(checkpoint_every=-1), "checkpoint_every must be a non-negative integer"),
    (config.LoggingSection, dict(log="carrier-pigeon"), "carrier-pigeon"),
    (config.LaunchSection, dict(launcher="srun"), "launcher must be one of"),
])
def test_each_section_checks_itself(section, kw, needle):
    with pytest.raises(config.GridError) as e:
        section(**kw)
    assert needle in str(e.value)
    if section is not config.LaunchSection:  # the same check where the section is part of the job's
        with pytest.raises(config.GridError, match=re.escape(needle)):
            TrainConfig(**kw)


def test_the_launch_table_is_checked_too(tmp_path):
    path = tmp_path / "launch.toml"
    path.write_text('[launch]\nlauncher = "srun"\n')
    r = _cli("--config", path, "--print-config")
    assert r.returncode == 2 and "--launcher must be one of auto, torchrun, mpirun, got 'srun'" in r.stderr, r.stderr


def test_a_printed_config_reads_back_to_the_command_lines(tmp_path):
    """A command line's configuration, dumped and loaded, is the same TrainConfig (tp's spellings
    None, "none" and a flag's are one)."""
    for argv in ([], ["--tp", "row:2", "--dp", "2", "--no-offload", "--sync-save"]):
        path = tmp_path / "printed.toml"
        path.write_text(configfile.dump(cli.parse_train(argv)))
        assert TrainConfig(**configfile.load(path)[0]) == cli.parse_train(argv)
    assert cli.parse_train([]) == TrainConfig(tp="none") == TrainConfig(tp=None)


def test_a_train_config_is_its_sections():
    cfg = TrainConfig(hidden=64, heads=4, lr=1e-3, tp="row:2", zero=1)
    assert all(isinstance(cfg, s) for s in config.JOB_SECTIONS) and not isinstance(cfg, config.LaunchSection)
    opt = cfg.section(config.OptimizerSection)
    assert type(opt) is config.OptimizerSection and (opt.lr, opt.offload) == (1e-3, "auto")
    assert cfg.section(config.ModelSection).hidden == 64 and cfg.mode.spec() == "row:2"
    assert dataclasses.replace(cfg, steps=5) == TrainConfig(hidden=64, heads=4, lr=1e-3, tp="row:2", zero=1, steps=5)
    assert gw.train.TrainConfig is config.TrainConfig  # the older home, the same class


def test_the_main_job_config_is_the_command_lines_defaults():
    fields, launch = configfile.load(MAIN_JOB)
    # the defaults, the grid resolved on 8 ranks (the file spells the mode: tp = "none")
    assert TrainConfig(**fields) == TrainConfig(dp=4, pp=2, tp="none")
    assert launch["nproc"] == 8


def test_flags_override_the_file_and_print_config_reads_back(tmp_path):
    r = _cli("--config", MAIN_JOB, "--steps", "7", "--tp", "row:2", "--dp", "2", "--pp", "2", "--print-config")
    assert r.returncode == 0, r.stderr
    doc = tomllib.loads(r.stdout)
    assert doc["training"]["steps"] == 7 and doc["parallelism"]["tp"] == "row:2"
    assert doc["model"] == tomllib.loads(MAIN_JOB.read_text())["model"]  # the rest from the file
    path = tmp_path / "printed.toml"
    path.write_text(r.stdout)
    fields, _ = configfile.load(path)
    assert TrainConfig(**fields) == TrainConfig(**{**configfile.load(MAIN_JOB)[0], "steps": 7, "tp": "row:2", "dp": 2,
                                                   "pp": 2})


@pytest.mark.parametrize("text, needle", [
    ("[model]\nhiden = 64\n", "unknown key model.hiden"),
    ("[model]\nsteps = 64\n", "unknown key model.steps (it belongs in [training])"),
    ("[training]\nsteps = \"300\"\n", "training.steps = '300' must be int"),
    ("[optimizer]\nlr = true\n", "optimizer.lr = True must be float"),
    ("[modle]\nhidden = 64\n", "unknown section [modle]"),
    ("hidden = 64\n", "'hidden' must be a section"),
    ("[model\nhidden = 64\n", "is not TOML"),
    ("[launch]\nnproc = 2.5\n", "launch.nproc = 2.5 must be int"),
])
def test_a_bad_config_is_one_error_naming_key_and_file(tmp_path, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    r = _cli("--config", cfg, "--out", tmp_path / "run")
    assert r.returncode == 2 and needle in r.stderr and str(cfg) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_missing_config_file_is_one_error(tmp_path):
    r = _cli("--config", tmp_path / "none.toml", "--out", tmp_path / "run")
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr


def test_the_7b_config_dry_run_counts_what_transformers_counts():
    """The 7B-class example on meta tensors: transformers' own LlamaForCausalLM of the same shape
    has as many parameters; the memory per rank is the planner's for the grid on 64 ranks."""
    import torch
    import transformers

    r = _cli("--config", LLAMA_7B, "--dry-run")
    assert r.returncode == 0, r.stderr
    fields, launch = configfile.load(LLAMA_7B)
    cfg = TrainConfig(**fields)
    hf = transformers.LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
                                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                  num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq)
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.LlamaForCausalLM(hf).parameters())
    assert f"{count:,} parameters" in r.stdout, (count, r.stdout)
    assert "64 ranks (8 x 8): dp 4 x pp 2 x tp row:8 x sp 1" in r.stdout, r.stdout
    shape = plan.GridShape(dp=4, pp=2, tp=cfg.mode, zero=1)
    p = plan.predict(plan.model_of(cfg), shape, plan.load_cluster("local", 8), microbatches=cfg.microbatches,
                     coarsening=cfg.coarsening, recompute=True)
    assert f"{p['memory_bytes'] / 2 ** 30:.2f} GiB on the device" in r.stdout, (p["memory_bytes"], r.stdout)


def test_a_run_records_its_resolved_config(tmp_path):
    """A main job started from a config writes the configuration it ran (grid resolved) into its
    folder; that file starts the same job again."""
    out = tmp_path / "run"
    r = _cli("--config", MAIN_JOB, "--nproc", "2", "--launcher", "torchrun", "--steps", "2", "--hidden", "32",
             "--heads", "4", "--layers", "2", "--seq", "32", "--batch", "4", "--val-every", "0",
             "--sample-tokens", "0", "--quiet", "--dp", "0", "--pp", "0", "--out", out, port=29651)
    assert r.returncode == 0, r.stderr[-2000:]
    fields, launch = configfile.load(out / "config.toml")
    ran = TrainConfig(**fields)
    assert (ran.dp, ran.pp, ran.steps, ran.hidden, ran.out) == (1, 2, 2, 32, str(out))
    assert (launch["nproc"], launch["nnodes"]) == (2, 1)  # what ran, not the file's 8
    assert json.loads((out / "metrics.json").read_text())["grid"] == {"dp": 1, "pp": 2, "sp": 1}
