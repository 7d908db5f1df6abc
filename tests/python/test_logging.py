"""The main job's loggers (gw.loggers, --log): TensorBoard's event files, the offline W&B run and
the JSON lines read back hold metrics.json's numbers; a logger that is unknown or not installed is
one error before anything starts."""
import glob
import json
import os
import subprocess
import sys

import pytest

from gridweave import loggers

STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("logged") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29670", "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "2", "--launcher", "torchrun",
                        "--pp", "2", "--steps", str(STEPS), "--hidden", "32", "--heads", "4", "--layers", "2", "--seq",
                        "32", "--batch", "4", "--val-every", "3", "--sample-tokens", "0", "--log",
                        "tensorboard,wandb,jsonl", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"logging to tensorboard, wandb, jsonl in {out / 'logs'}" in r.stdout, r.stdout[-2000:]
    return out, json.loads((out / "metrics.json").read_text())


def _close(a, b, rel=1e-6):
    return len(a) == len(b) and all(abs(x - y) <= rel * max(1.0, abs(y)) for x, y in zip(a, b))


def test_tensorboard_holds_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, m = run
    ev = EventAccumulator(str(out / "logs" / "tensorboard"))
    ev.Reload()

    def series(tag):
        return [(e.step, e.value) for e in ev.Scalars(tag)]

    assert [s for s, _ in series("train/loss")] == list(range(1, STEPS + 1))
    assert _close([v for _, v in series("train/loss")], m["loss"])  # float32 in the event file
    assert _close([v for _, v in series("train/lr")], m["lr"])
    assert _close([v for _, v in series("perf/tokens_per_s")], m["tokens_per_s"])
    assert _close([v for _, v in series("perf/mfu")], m["mfu"])
    assert series("val/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in m["val_loss"]]
    assert all(v > 0 for _, v in series("comm/pp/bytes")) and all(v > 0 for _, v in series("comm/pp/messages"))
    assert all(v > 0 for _, v in series("perf/predicted_step_time_s"))
    assert "config" in ev.Tags()["tensors"] or "config/text_summary" in ev.Tags()["tensors"]


def test_jsonl_holds_the_metrics_exactly(run):
    out, m = run
    lines = [json.loads(x) for x in (out / "logs" / "log.jsonl").read_text().splitlines()]
    assert lines[0]["config"]["steps"] == STEPS and lines[0]["config"]["grid"] == {"dp": 1, "pp": 2, "sp": 1}
    steps = lines[1:]
    assert [x["step"] for x in steps] == list(range(1, STEPS + 1))
    assert [x["train/loss"] for x in steps] == m["loss"]
    assert [x["train/grad_norm"] for x in steps] == m["grad_norm"]
    assert [[x["step"], x["val/loss"]] for x in steps if "val/loss" in x] == m["val_loss"]


def test_the_offline_wandb_run_holds_the_metrics(run):
    """W&B's own offline mode (no network here): its run file records every logged value (the
    history items carry their values as JSON text) and the config."""
    out, m = run
    files = glob.glob(str(out / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    raw = open(files[0], "rb").read()
    for key in ("train/loss", "val/loss", "perf/tokens_per_s", "comm/pp/bytes"):
        assert key.encode() in raw, key
    for v in m["loss"] + [v for _, v in m["val_loss"]]:
        assert json.dumps(v).encode() in raw, v


def test_a_change_of_world_reaches_tensorboard_and_the_json_log(tmp_path):
    """An elastic restart's record (train.note_restart's) at the step it resumed from: TensorBoard's
    scalars and text, the JSON log's line, as the record says."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = {"restart": 1, "step": 4, "previous_world": 6, "previous_grid": "dp=3,pp=2,sp=1", "world": 4,
              "grid": "dp=2,pp=2,sp=1", "tp": "none", "seconds_lost": 12.5}
    log = loggers.RunLog((loggers.Sink.TENSORBOARD, loggers.Sink.JSONL), tmp_path, 0, {}, "run")
    log.restart(4, record)
    log.close()
    ev = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("restart/world")] == [(4, 4.0)]
    assert [(e.step, e.value) for e in ev.Scalars("restart/seconds_lost")] == [(4, 12.5)]
    text = ev.Tensors("restarts/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "6 ranks (dp=3,pp=2,sp=1) -> 4 ranks (dp=2,pp=2,sp=1)" in text, text
    lines = [json.loads(x) for x in (tmp_path / "logs" / "log.jsonl").read_text().splitlines()]
    assert lines[-1] == {"step": 4, "restart": record}


def test_a_change_of_world_recorded_but_not_logged_is_logged_by_the_next_start(tmp_path):
    """A start that recorded its change of world (restarts.jsonl) and ended before logging it (an
    elastic job's node back at once): the next start logs it before its own, so the JSON log holds
    metrics.json's restarts in order; without a JSON log a start logs its own alone."""
    from gridweave import train

    shrink = {"restart": 1, "step": 2, "previous_world": 6, "previous_grid": "dp=3,pp=2,sp=1", "world": 4,
              "grid": "dp=2,pp=2,sp=1", "tp": "none", "seconds_lost": 20.25}
    grow = {**shrink, "previous_world": 4, "previous_grid": "dp=2,pp=2,sp=1", "world": 6, "grid": "dp=3,pp=2,sp=1"}
    (tmp_path / train.RESTARTS).write_text(json.dumps(shrink) + "\n" + json.dumps(grow) + "\n")
    log = loggers.RunLog((loggers.Sink.JSONL,), tmp_path, 0, {}, "run")
    assert log.logged_restarts() == []
    missing = train.unlogged_restarts(tmp_path, log, grow)
    assert missing == [shrink, grow]
    for r in missing:
        log.restart(r["step"], r)
    assert train.unlogged_restarts(tmp_path, log, grow) == []
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "logs" / "log.jsonl").read_text().splitlines()]
    assert [e["restart"] for e in lines if "restart" in e] == train.restarts(tmp_path)
    tb = loggers.RunLog((loggers.Sink.TENSORBOARD,), tmp_path / "tb", 0, {}, "run")
    assert train.unlogged_restarts(tmp_path, tb, grow) == [grow] and train.unlogged_restarts(tmp_path, tb, None) == []
    tb.close()


def test_expert_loads_reach_tensorboard_as_histograms_and_the_json_log(tmp_path):
    """A layer's slots per expert: TensorBoard's histogram over the expert ids (each bucket an
    expert's count), the JSON log's counts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = loggers.RunLog((loggers.Sink.TENSORBOARD, loggers.Sink.JSONL), tmp_path, 0, {}, "run")
    log.loads(3, "moe/layer2/tokens_per_expert", [5, 0, 9, 2])
    log.close()
    ev = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    ev.Reload()
    (h,) = ev.Histograms("moe/layer2/tokens_per_expert")
    assert h.step == 3 and list(h.histogram_value.bucket) == [5, 0, 9, 2] and h.histogram_value.num == 16
    assert list(h.histogram_value.bucket_limit) == [0.5, 1.5, 2.5, 3.5]
    lines = [json.loads(x) for x in (tmp_path / "logs" / "log.jsonl").read_text().splitlines()]
    assert lines[-1] == {"step": 3, "moe/layer2/tokens_per_expert": [5, 0, 9, 2]}


def test_auto_logs_to_wandb_only_where_it_is_configured(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert loggers.Sink.WANDB not in loggers.parse("auto")
    assert loggers.Sink.JSONL in loggers.parse("auto") and loggers.parse("none") == ()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert (loggers.Sink.WANDB in loggers.parse("auto")) == (loggers.Sink.WANDB in loggers.installed())


def test_a_missing_logger_is_one_error(monkeypatch, tmp_path):
    monkeypatch.setattr(loggers, "installed", lambda: (loggers.Sink.JSONL,))
    with pytest.raises(loggers.GridError, match=r"log=tensorboard: tensorboard is not installed \(pip install"):
        loggers.parse("jsonl,tensorboard")
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "2", "--log", "tensorboard,visdom",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--log 'visdom' is not a logger" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_run_folder_records_what_ran(run):
    """One folder: the resolved config, the logs, metrics, plots, checkpoints and the environment
    (versions, the commit gridweave was installed from, the grid)."""
    import torch

    out, m = run
    for name in ("config.toml", "environment.json", "metrics.json", "loss.png", "run.png", "tokenizer.json",
                 "logs/log.jsonl", "checkpoint/latest"):
        assert (out / name).exists(), name
    assert int.from_bytes((out / "run.png").read_bytes()[16:20], "big") == 15 * 90  # PNG's width: three columns
    env = json.loads((out / "environment.json").read_text())
    assert env["versions"]["torch"] == torch.__version__ and env["grid"] == m["grid"] and env["world_size"] == 2
    source = env["gridweave_source"]
    if source is not None:  # installed from a git checkout (pip's direct_url.json): its HEAD then
        head = subprocess.run(["git", "-C", source["path"], "rev-parse", "HEAD"], capture_output=True, text=True)
        assert source["commit"] == head.stdout.strip()
