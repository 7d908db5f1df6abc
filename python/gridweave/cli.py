"""`gridweave` command line: train (the main job)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import uuid

from pathlib import Path

from . import autogrid, calibrate, checkpoint, configfile, data, launch, models, modes, pipeline, plan, runfolder
from . import flight, train, verify
from .errors import CommError, Diverged, GridError
from .generate import check_sampling, sample
from .hf import save_hf
from .precision import PRECISIONS
from .config import AUTO, JOB_SECTIONS, SECTIONS, LaunchSection, TrainConfig, choices
from .train import load_model


# a field's annotation -> argparse's type (the rest are strings, checked by their section)
_FLAG_TYPES = {"int": int, "float": float, "float | None": float, "int | None": int}


def _section_flags(p, section) -> None:
    """One argument group a section, one flag a field, generated from the section's declaration."""
    g = p.add_argument_group(section.TITLE)
    for f in section.declared():
        meta = f.metadata
        kw = dict(default=f.default, help=meta["help"] or None)
        if f.type == "bool":
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            if f.type in _FLAG_TYPES:
                kw["type"] = _FLAG_TYPES[f.type]
            if meta["choices"] is not None:
                kw["choices"] = list(meta["choices"])
        g.add_argument("--" + f.name.replace("_", "-"), **{**kw, **(meta["cli"] or {})})
        for flag, extra in meta["flags"]:
            g.add_argument(flag, **extra)


def _job_flags(p):
    """train's flags (every section's, and --config), which verify takes too; returns --config's group."""
    for section in (LaunchSection, *JOB_SECTIONS):  # the TOML file's tables, the launcher's first
        _section_flags(p, section)
    c = p.add_argument_group("configuration file")
    c.add_argument("--config", default=None,
                   help="a TOML file of sections (" + ", ".join(sec.NAME for sec in SECTIONS) + ") whose keys are "
                        "these flags' names; flags given as well override it")
    return c


def _train_parser(sub):
    p = sub.add_parser("train", help="train a Llama-style model (or the GPT, or BERT's masked LM) on a tokenized text "
                                     "corpus over ranks")
    c = _job_flags(p)
    c.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    c.add_argument("--dry-run", action="store_true",
                   help="build the model on meta tensors, print its parameters, the grid and the memory per rank "
                        "(the planner's model), and exit without starting a rank")
    return p


def _generate_parser(sub):
    p = sub.add_parser("generate", help="sample from a trained run (its checkpoint, from any grid)")
    p.add_argument("--run", required=True, help="the run folder (gridweave train --out)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="0: the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)
    return p


def _generate(args) -> int:
    if args.top_k < 0:
        raise GridError(f"--top-k must be >= 0 (0: the whole vocabulary), got {args.top_k}")
    check_sampling(args.tokens, args.temperature, args.top_k or None)  # before the model is read
    model, tok, _ = load_model(args.run)
    ids = data.check_encodable(tok, args.prompt, "the prompt")
    out = sample(model, ids, args.tokens, args.temperature, args.top_k or None, args.seed, tok.vocab_size)
    print(tok.decode(out))
    return 0


def _export_parser(sub):
    p = sub.add_parser("export", help="write a run's model as a Hugging Face folder (config.json + safetensors)")
    p.add_argument("--run", required=True, help="the run folder (gridweave train --out)")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--format", default="hf", choices=["hf", "dense"],
                   help="hf: config.json + model.safetensors that transformers' from_pretrained loads; dense: "
                        "gridweave's dense model (model.safetensors under gw.models names + model_config.json)")
    return p


def _export(args) -> int:
    model, tok, _ = load_model(args.run)  # one process, shard by shard: any grid's checkpoint
    source = Path(args.run) / runfolder.HF_SOURCE
    if args.format == "hf":  # a run from --init-from writes back the config and generation config it read
        save_hf(model, args.out, tok.special_ids(), source=source if (source / "config.json").is_file() else None)
    else:
        import json

        from safetensors.torch import save_file

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie:
            state.pop("head.out.weight", None)  # the same tensor as embed.tok.weight
        save_file(state, str(out / "model.safetensors"))
        (out / "model_config.json").write_text(json.dumps(model.config.to_dict(), indent=1))
    run_tok = Path(args.run) / data.TOKENIZER_FILE
    if args.format == "hf" and tok.kind == "bpe" and not (Path(args.run) / data.TOKENIZER_FILES[0]).exists():
        tok.save_hf(Path(args.out))  # a tokenizer trained here: its special tokens named for AutoTokenizer
    elif run_tok.exists():  # with its Hugging Face files (special tokens, chat template)
        data.copy_tokenizer(run_tok, Path(args.out))
    print(f"wrote {args.out}")
    return 0


# The launcher's own flags: torchrun would read them as its own (--nproc as --nproc-per-node),
# and a spawned rank needs none (GRIDWEAVE_SPAWNED says it is one).
_LAUNCHER_FLAGS = ("--nproc", "--launcher", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                   "--max-restarts", "--hostfile")


def _without_launcher_flags(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _LAUNCHER_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in _LAUNCHER_FLAGS)):
            out.append(a)
    return out


def _plan_parser(sub):
    legend = "the table's columns:\n" + "\n".join(f"  {k:<24} {v}" for k, v in plan.TABLE_COLUMNS.items())
    p = sub.add_parser("plan", help="rank grids by predicted step time and memory (gw.plan)", epilog=legend,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="ranks to plan for (default with --grid: its size)")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--cluster", default="a100-ib", help="v100-ib | a100-ib | h100-ib | local | a JSON file")
    p.add_argument("--model", default=None,
                   help="a Hugging Face config.json (or its folder), a gridweave run folder or model_config.json, "
                        "or llama | gpt (default: the model `gridweave train` builds from the same flags); "
                        "--hidden etc. override its sizes")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="default: the model config's context length")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--vocab", type=int, default=None, help="default: the config's, else train's")
    p.add_argument("--kv-heads", type=int, default=None, help="train's model: its key/value heads (default: train's)")
    p.add_argument("--precision", default=TrainConfig.precision, help="train's model: its precision")
    p.add_argument("--experts", type=int, default=None,
                   help="train's mixture-of-experts models: routed experts per layer")
    p.add_argument("--top-k", type=int, default=None, help="train's mixture-of-experts models: experts per token")
    p.add_argument("--moe-ffn", type=int, default=None,
                   help="train's mixture-of-experts models: each expert's hidden width")
    p.add_argument("--expert-imbalance", type=float, default=None,
                   help="a mixture of experts: the most loaded expert's tokens over the mean (default 1: balanced)")
    p.add_argument("--from-run", default=None, metavar="OUT",
                   help="a run folder: its model (as --model OUT) and the expert imbalance its steps measured "
                        "(metrics.json's tokens per expert: the busiest expert over an even share, averaged over "
                        "layers and steps) in place of --expert-imbalance")
    p.add_argument("--grid", default=None, metavar="SPEC",
                   help='evaluate this grid instead of ranking them all: "dp=32,pp=8,tp=row:8" (keys dp, pp, tp, sp, '
                        "zero, placement, schedule, chunks, ep); prints its breakdown")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help="with --grid: sequences per micro-batch (default: the fastest that fits)")
    p.add_argument("--recompute", default="none", choices=("none", "full", "selective"),
                   help="with --grid: activation recomputation (full: every layer's forward again in backward; "
                        "selective: the attention core's)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes that predict the grids (default: one per core, each given 256 grids or more)")
    p.add_argument("--schedules", default=pipeline.AUTO, metavar="LIST",
                   help="the pipeline schedules ranked on grids with stages, a comma list of "
                        f"{', '.join(s for s in pipeline.SCHEDULE_NAMES if s != 'interleaved')} (default: auto)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--explain", type=int, default=None, metavar="N",
                   help="why grid N (1-based, as listed) ranks above grid N+1, part by part")
    p.add_argument("--json", action="store_true")
    return p


def _plan(args) -> int:
    import json

    try:
        cluster = plan.load_cluster(args.cluster, args.gpus_per_node)
        sizes = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        imbalance = 1.0 if args.expert_imbalance is None else args.expert_imbalance
        if args.from_run is not None:
            if args.model is not None or args.expert_imbalance is not None:
                raise GridError("--from-run sets the model and the expert imbalance: leave out --model and "
                                "--expert-imbalance")
            imbalance, steps, layers = runfolder.measured_imbalance(args.from_run)
            args.model = args.from_run
            print(f"gridweave plan: expert imbalance {imbalance:.3f}, as {args.from_run} measured it ({steps} steps x "
                  f"{layers} layers)", file=sys.stderr)
        if args.model and args.model not in choices("model"):  # a config file or a run folder
            model = plan.model_from(args.model, args.batch, args.seq, **sizes)
        else:  # the main job's model, as `gridweave train` builds it from the same flags
            given = {k: v for k, v in dict(sizes, seq=args.seq, kv_heads=args.kv_heads, experts=args.experts,
                                           top_k=args.top_k, moe_ffn=args.moe_ffn).items() if v is not None}
            cfg = TrainConfig(model=args.model or TrainConfig.model, batch=args.batch, precision=args.precision,
                              **given)
            model = plan.model_of(cfg)
        model = dataclasses.replace(model, expert_imbalance=imbalance)
        if args.grid is not None:
            return _plan_grid(args, model, cluster)
        if args.gpus is None:
            raise GridError("--gpus: how many ranks to plan for (or --grid, one grid to evaluate)")
        schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
        bad = [x for x in schedules if x not in pipeline.SCHEDULE_NAMES or x == "interleaved"]
        if bad or not schedules:
            raise GridError(f"--schedules {args.schedules!r}: choose from "
                            f"{', '.join(s for s in pipeline.SCHEDULE_NAMES if s != 'interleaved')}")
        rows = plan.plan(args.gpus, model, cluster, workers=args.workers, schedules=schedules)
        if not args.json:  # the table: rows that differ only in a stage that changes nothing, as one
            rows = plan.fold_equal(rows)
        if args.explain is not None and not 1 <= args.explain < len(rows):
            raise GridError(f"--explain {args.explain}: choose a grid from 1 to {len(rows) - 1} (it is compared "
                            "with the next)")
        why = plan.explain(rows, args.explain - 1) if args.explain is not None else None
    except GridError as e:
        print(f"gridweave plan: {e}", file=sys.stderr)
        return 2
    rows = rows[:args.top] if args.top else rows
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.gpus} GPUs, {cluster.gpus_per_node} per node ({cluster.name}); "
          f"{model.layers} layers, hidden {model.hidden}, heads {model.heads}, seq {model.seq}, batch {model.batch}, "
          f"vocab {model.vocab}")
    print(f"{'#':>3} {'dp':>4} {'pp':>3} {'tp':>12} {'sp':>3} {'ep':>3} {'zero':>4} {'placement':>9} {'schedule':>14} {'mb':>4} "
          f"{'step ms':>9} {'compute':>8} "
          f"{'bubble':>7} {'comm per axis ms':<28} {'mem GiB':>8} {'(param/grad/optim/act)':<24}")
    for i, r in enumerate(rows):
        t, mem = r["time_breakdown_s"], r["memory_breakdown_bytes"]
        comm = " ".join(f"{k}={v * 1e3:.2f}" for k, v in t["communication"].items() if v)
        parts = "/".join(f"{mem[k] / 2 ** 30:.2f}" for k in ("parameters", "gradients", "optimizer", "activations"))
        print(f"{i + 1:>3} {r['dp']:>4} {r['pp']:>3} {r['tp']:>12} {r['sp']:>3} {r['ep']:>3} {r['zero']:>4} {r['placement']:>9} "
              f"{r['schedule']:>14} {r['microbatches']:>4} "
              f"{r['step_time_s'] * 1e3:>9.2f} {(t['compute'] + t['recompute']) * 1e3:>8.2f} {t['bubble'] * 1e3:>7.2f} "
              f"{comm or '-':<28} {r['memory_bytes'] / 2 ** 30:>8.2f} {parts:<24}{'' if r['fits'] else ' (does not fit)'}")
    print("(a|b: grids equal in time and memory but for this column; the columns: gridweave plan --help)")
    if why:
        print()
        print("\n".join(why))
    return 0


RECOMPUTE = {"none": False, "full": True, "selective": "selective"}  # --recompute -> plan.predict's recompute


def _plan_grid(args, model, cluster) -> int:
    """`gridweave plan --grid SPEC`: one grid's prediction and its breakdown (raises GridError)."""
    import json

    grid = plan.GridShape.parse(args.grid)
    n = grid.dims().world_size
    if args.gpus is not None and args.gpus != n:
        raise GridError(f"--grid {args.grid} has {n} ranks, --gpus says {args.gpus}")
    kw = dict(recompute=RECOMPUTE[args.recompute])
    if args.microbatch_size is None:
        r = plan.best_microbatching(model, grid, cluster, **kw)
    else:
        per_replica = model.batch // grid.dp
        if args.microbatch_size < 1 or model.batch % grid.dp or per_replica % args.microbatch_size:
            raise GridError(f"--microbatch-size {args.microbatch_size} does not divide the {per_replica} sequences "
                            f"of a dp replica (batch {model.batch} over dp {grid.dp})")
        grid.check(model, per_replica // args.microbatch_size)  # what train would refuse
        r = plan.predict(model, grid, cluster, microbatches=per_replica // args.microbatch_size, **kw)
    r["fits"] = r["memory_bytes"] <= cluster.memory_bytes
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    t, mem = r["time_breakdown_s"], r["memory_breakdown_bytes"]
    print(f"{n} GPUs, {cluster.gpus_per_node} per node ({cluster.name}); {model.layers} layers, hidden {model.hidden}, "
          f"heads {model.heads}, seq {model.seq}, batch {model.batch}, vocab {model.vocab}")
    print(f"grid: dp {r['dp']} x pp {r['pp']} x tp {r['tp']} x sp {r['sp']}, zero {r['zero']}, {r['placement']} "
          f"placement, schedule {r['schedule']}, {r['chunks']} chunk(s) a stage; {r['microbatches']} micro-batches, "
          f"recompute {args.recompute}")
    print(f"step: {r['step_time_s'] * 1e3:.2f} ms")
    parts = [("compute", t["compute"]), ("recomputation", t["recompute"]), ("pipeline bubble", t["bubble"])]
    parts += [(f"communication on {k}", v) for k, v in t["communication"].items()]
    for name, v in parts:
        print(f"  {name:32s} {v * 1e3:10.3f} ms")
    print(f"memory per GPU: {r['memory_bytes'] / 2 ** 30:.3f} GiB{'' if r['fits'] else ' (does not fit)'}")
    for k, v in mem.items():
        print(f"  {k:32s} {v / 2 ** 30:10.3f} GiB")
    print("bytes a step per GPU, by axis (inside / across nodes):")
    for k, v in r["bytes_per_axis"].items():
        print(f"  {k:32s} {v['intra'] / 2 ** 20:10.2f} / {v['inter'] / 2 ** 20:.2f} MiB ({r['axis_links'][k]})")
    return 0


def _verify_parser(sub):
    p = sub.add_parser("verify", help="check that a job's parallel configuration computes what one process computes "
                                      "(a float64 replica on CPU ranks against the dense model), or fuzz them all")
    _job_flags(p)
    v = p.add_argument_group("verify")
    v.add_argument("--verify-steps", type=int, default=verify.STEPS, help="steps the replica and one process compare")
    v.add_argument("--ranks", type=int, default=verify.RANKS,
                   help="CPU ranks the replica may take (each degree of 2 or more stays at least 2)")
    v.add_argument("--fuzz", type=int, default=0, metavar="N",
                   help="verify N random configurations train accepts (--seed S: the draw's), not this job's; a "
                        "one-line repro command for each that fails")
    return p


def _verify(args, parser, argv) -> int:
    """gridweave verify: the launcher checks the job (train's errors), says what the replica keeps
    and reduces, starts its ranks on this machine and prints their report: exit 0 ok, 1 a
    divergence (its first), 2 a bad job. A rank of it (GRIDWEAVE_VERIFY_JOB set) runs gw.verify.run."""
    try:  # --config's values under the flags, on the launcher and on each rank alike
        args = with_config_file(args, parser, argv)
    except GridError as e:
        print(f"gridweave verify: {e}", file=sys.stderr)
        return 2
    if os.environ.get(VERIFY_JOB):
        return _verify_rank(args)
    try:
        if args.fuzz < 0:
            raise GridError(f"--fuzz must be 0 or a positive integer, got {args.fuzz}")
        for name in ("verify_steps", "ranks"):
            if getattr(args, name) < 1:
                raise GridError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
        if args.fuzz:
            return _fuzz(args)
        LaunchSection(**launch_fields(args))  # the job's nodes, checked: they say its world
        if args.nproc < 1:
            raise GridError("verify starts its own ranks on this machine: give the job's --nproc (and --nnodes); "
                            "inside a launched world, call gw.verify.run on every rank")
        job_world = args.nproc * launch.node_range(args.nnodes)[1]
        cfg = train_config(args)
        if cfg.grid == AUTO:  # the grid the job would run on, and its ranks take it (autogrid.GRID_ENV)
            cfg = autogrid.plan_for_ranks(cfg, job_world, args.nproc)[0]
        replica, lines, world = verify.scale_down(cfg, job_world, args.ranks)
    except (GridError, OSError) as e:
        print(f"gridweave verify: {as_flags(getattr(e, 'strerror', None) or e)}", file=sys.stderr)
        return 2
    print(f"gridweave verify: the job on {job_world} ranks as {verify.describe(replica, world)} on {world} CPU "
          f"ranks in float64 ({'; '.join(lines)})", flush=True)
    report = _verify_ranks(_without_launcher_flags(argv), world, job_world, args.verify_steps,
                           args.master_port, args.timeout)
    if report is None:
        return 2
    print(report.line())
    return 0 if report.ok else 1


VERIFY_JOB = "GRIDWEAVE_VERIFY_JOB"  # a verify rank's environment: the job's world size ...
VERIFY_REPORT = "GRIDWEAVE_VERIFY_REPORT"  # ... and where rank 0 writes the report


def _verify_ranks(rank_argv, world: int, job_world: int, steps: int, port, timeout: float):
    """Start `world` ranks of `gridweave verify rank_argv` here; their Report, or None (they said why)."""
    with tempfile.TemporaryDirectory(prefix="gridweave-verify-") as tmp:
        path = Path(tmp) / "report.json"
        ours = {VERIFY_JOB: str(job_world), VERIFY_REPORT: str(path), "GRIDWEAVE_SPAWNED": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        before = {k: os.environ.get(k) for k in ours}  # the ranks inherit ours; the caller keeps its own
        os.environ.update(ours)
        try:
            nodes = launch.Nodes(nproc=world, master_port=port or launch.default_port())
            code = launch.torchrun(nodes, ["gridweave.cli", "verify", *rank_argv, "--verify-steps", str(steps)],
                                   uuid.uuid4().hex, timeout)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if code or not path.exists():
            return None
        return verify.Report.from_dict(json.loads(path.read_text()))


def _verify_rank(args) -> int:
    launch.die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        job_world = int(os.environ[VERIFY_JOB])
        report = verify.run(autogrid.chosen_grid(train_config(args), job_world, args.nproc), steps=args.verify_steps,
                            job_world=job_world)
    except (GridError, CommError) as e:
        if rank == 0:
            print(f"gridweave verify: {as_flags(e)}", file=sys.stderr)
        return 2
    if rank == 0:
        checkpoint.atomic_write(Path(os.environ[VERIFY_REPORT]),
                                lambda t: Path(t).write_text(json.dumps(report.to_dict())))
    return 0


def _flags_of(cfg: TrainConfig) -> list:
    """The command-line words of cfg's fields that differ from train's defaults."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        if not f.init or getattr(cfg, f.name) == f.default:
            continue
        v, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if isinstance(v, bool) and f.type == "bool":
            out.append(flag if v else "--no-" + flag[2:])
        else:
            # offload's words are on / off; an unset clipping norm (None) is written 0
            out += [flag, {True: "on", False: "off"}.get(v, str(v)) if f.name == "offload" else
                    "0" if v is None else str(v)]
    return out


def _fuzz(args) -> int:
    """--fuzz N: N drawn configurations verified one after the other, each by its own `gridweave
    verify` (the repro command printed for each that fails is exactly what ran)."""
    rng = random.Random(args.seed)
    failed = 0
    for i in range(args.fuzz):
        cfg, world = verify.draw(rng, args.ranks)
        flags = ["--nproc", str(world), *_flags_of(cfg), "--verify-steps", str(args.verify_steps), "--ranks",
                 str(args.ranks)]
        env = {**os.environ, launch.PORT_ENV: str((args.master_port or launch.default_port()) + i % 100)}
        try:
            ran = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", *flags], capture_output=True,
                                 text=True, env=env, timeout=args.timeout * 4)
            said = (ran.stdout.strip().splitlines() or [""])[-1] if ran.returncode in (0, 1) else \
                "error: " + " / ".join(ran.stderr.strip().splitlines()[-3:])
            code = ran.returncode
        except subprocess.TimeoutExpired:
            said, code = f"error: no answer in {args.timeout * 4:.0f} s", 2
        print(f"fuzz {i + 1}/{args.fuzz}: {verify.describe(cfg, world)}: {said}", flush=True)
        if code:
            failed += 1
            print("  repro: gridweave verify " + shlex.join(flags), flush=True)
    print(f"verify --fuzz {args.fuzz} --seed {args.seed}: {args.fuzz - failed} ok, {failed} failed")
    return 1 if failed else 0


def _flight_parser(sub):
    p = sub.add_parser("flight", help="name the rank that hung or failed a job, from its ranks' flight recorder dumps")
    p.add_argument("dir", help="the folder of rank<R>.json dumps (a run's flight/, or GRIDWEAVE_FLIGHT_DIR)")
    return p


def _flight(args) -> int:
    """The culprit's line first, then who waited on what; exit 1 with one line when the folder
    cannot be read."""
    try:
        report = flight.analyse(args.dir)
    except GridError as e:
        print(f"gridweave flight: {e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    return 0


def _bench_parser(sub):
    p = sub.add_parser("bench", help="measure this machine for gw.plan")
    p.add_argument("--calibrate", action="store_true", required=True,
                   help="measure alpha, beta and the GEMM rate into a 'local' cluster preset")
    p.add_argument("--nproc", type=int, default=8, help="ranks measuring at once (as many as your job runs)")
    p.add_argument("--out", default="runs/local.json")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS),
                   help="the compute precision of the jobs the preset will plan (a GPU's bf16 GEMM is many times "
                        "its fp32 one)")
    return p


class _Parser(argparse.ArgumentParser):
    """argparse, answering bad input with one line (exit 2) and the nearest flag for a mistyped one."""

    def error(self, message):
        import difflib

        bad = re.match(r"unrecognized arguments: (\S+)", message)
        if bad:
            flags = [o for p in _parsers(self) for a in p._actions for o in a.option_strings]
            word = bad.group(1).split("=")[0]
            near = difflib.get_close_matches(word, flags, n=5, cutoff=0.6)
            # equally close: the one that starts alike (--dpp: --dp, not --pp)
            near = sorted(near, key=lambda f: (-difflib.SequenceMatcher(None, word, f).ratio(),
                                               -len(os.path.commonprefix([word, f]))))
            message = f"unrecognized argument {bad.group(1)}" + (f"; did you mean {near[0]}?" if near else "")
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _parsers(parser) -> list:
    """parser and its subcommands' parsers."""
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += [q for p in dict.fromkeys(a.choices.values()) for q in _parsers(p)]
    return out


def main(argv=None) -> int:
    ap = _Parser(prog="gridweave")
    sub = ap.add_subparsers(dest="command", required=True)
    train_parser = _train_parser(sub)
    _generate_parser(sub)
    _export_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    _flight_parser(sub)
    verify_parser = _verify_parser(sub)
    args = ap.parse_args(argv)
    if args.command == "verify":
        argv = list(sys.argv[1:] if argv is None else argv)
        return _verify(args, verify_parser, argv[argv.index("verify") + 1:])
    if args.command == "flight":
        return _flight(args)
    if args.command == "plan":
        return _plan(args)
    if args.command in ("generate", "export"):
        try:
            return (_generate if args.command == "generate" else _export)(args)
        except (GridError, OSError) as e:  # a missing run, a bad setting: one line, as train answers
            what = e if isinstance(e, GridError) or not e.strerror else \
                f"{e.strerror}: {e.filename}" if e.filename else e.strerror
            print(f"gridweave {args.command}: {what}", file=sys.stderr)
            return 2
    if args.command == "bench":
        if args.nproc < 1:
            print(f"gridweave bench: --nproc must be a positive integer, got {args.nproc}", file=sys.stderr)
            return 2
        if args.nproc > 1 and "RANK" not in os.environ:
            argv = _without_launcher_flags(list(sys.argv[1:] if argv is None else argv))
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                   "--master-port", os.environ.get("GRIDWEAVE_PORT", "29651"), "-m", "gridweave.cli", *argv]
            return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})

        preset = calibrate.run(args.out, PRECISIONS[args.precision].dtype)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"wrote {args.out}: alpha {preset['intra_alpha_s']:.2e} s, "
                  f"{preset['intra_bandwidth_Bps'] / 1e9:.2f} GB/s, GEMM {preset['gemm_flops'] / 1e9:.1f} GFLOP/s")
        return 0
    if args.command == "train":
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            args = with_config_file(args, train_parser, argv[argv.index("train") + 1:])
        except GridError as e:
            print(f"gridweave train: {e}", file=sys.stderr)
            return 2
        launcher_side = args.nproc > 0 and not launch.started_as_rank() and not os.environ.get("GRIDWEAVE_SPAWNED")
        if launcher_side or args.print_config or args.dry_run:  # the whole configuration, before any rank starts
            try:
                nodes = node_spec(args)
                cfg = train_config(args)
                chosen = None
                if cfg.grid == AUTO:  # planned once here; the ranks of this world take it (autogrid.GRID_ENV)
                    cfg, rows = autogrid.plan_for_ranks(cfg, nodes.world_size, nodes.nproc)
                    chosen = grid_choice(rows)
                shape = cfg.grid_shape(nodes.world_size)
                for world in nodes.worlds() if cfg.grid != AUTO else ():  # an elastic job's smaller worlds too
                    try:
                        (cfg.fitted_microbatches(world) if nodes.elastic else cfg).grid_shape(world)
                    except GridError as e:
                        raise GridError(f"--nnodes {args.nnodes}: on {world} ranks ({world // nodes.nproc} nodes) "
                                        f"{e}") from None
                if args.print_config:  # the grid's degrees as this world resolves them
                    resolved = dataclasses.replace(cfg, dp=shape["dp"], pp=shape["pp"])
                    print(configfile.dump(resolved, launch_fields(args)), end="")
                    return 0
                if args.dry_run:
                    return dry_run(cfg, nodes, shape)
                cfg.check_files()
                said = start_line(cfg, nodes, shape, _launcher(args) if nodes.world_size > 1 else "this process")
            except (GridError, OSError) as e:
                print(f"gridweave train: {as_flags(getattr(e, 'strerror', None) or e)}", file=sys.stderr)
                return 2
            if not cfg.quiet:  # what starts, said before any rank does
                print(chosen + "\n" + said if chosen else said, flush=True)
            if nodes.world_size == 1:
                os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            else:  # spawn the ranks, each running this command without the launcher's flags
                return _spawn(args, nodes, _without_launcher_flags(argv))
        return _train_rank(args)
    return 0


CONFIG_FILE = "config.toml"  # the run folder's resolved configuration (gridweave train --config reads it back)


def _reported_marker(run_id: str) -> str:
    """In the temp folder: the first rank of this node to create it reports (named after the host
    too: nodes that share a temp folder still say one line each; and the restart: a restarted
    job's failure is news)."""
    import socket
    import tempfile

    return os.path.join(tempfile.gettempdir(),
                        f"gridweave-{run_id}-{socket.gethostname()}-{launch.restart_count()}.reported")


def node_spec(args) -> launch.Nodes:
    """The command line's nodes, checked against its launcher and resume."""
    LaunchSection(**launch_fields(args))  # the launcher's own section, checked (a config file's too)
    launcher = _launcher(args)
    starts = not (args.print_config or args.dry_run)  # on paper, no master is needed
    low, high = launch.node_range(args.nnodes)
    if starts and high > 1 and args.master_addr is None and launcher == "torchrun":
        raise GridError(f"--nnodes {args.nnodes} needs --master-addr: the address every node reaches node 0 at")
    nodes = launch.Nodes(nproc=args.nproc, nnodes=high, min_nodes=low, node_rank=args.node_rank,
                         master_addr=args.master_addr or "127.0.0.1",
                         master_port=args.master_port or launch.default_port(), max_restarts=args.max_restarts)
    if nodes.elastic and args.node_rank:
        raise GridError(f"--node-rank with --nnodes {args.nnodes}: an elastic rendezvous numbers the nodes as they "
                        "come (leave --node-rank out)")
    if launcher == "mpirun":
        if nodes.elastic:
            raise GridError(f"--nnodes {args.nnodes} is torchrun's elastic rendezvous: use --launcher torchrun")
        if nodes.nnodes > 1 and args.hostfile is None:
            raise GridError("--launcher mpirun on --nnodes > 1 needs --hostfile (mpirun's list of the nodes)")
        if nodes.node_rank != 0:
            raise GridError("--launcher mpirun runs once, on the first node: mpirun starts every node's ranks "
                            "(--node-rank is torchrun's)")
        if nodes.max_restarts:
            raise GridError("--max-restarts is torchrun's elastic agent: use --launcher torchrun")
    elif args.hostfile is not None:
        raise GridError("--hostfile is mpirun's: use --launcher mpirun, or --nnodes / --node-rank / --master-addr "
                        "with torchrun")
    if nodes.max_restarts and args.resume != "auto":
        raise GridError("--max-restarts needs --resume auto: a restarted job continues from the newest checkpoint "
                        "of --out")
    return nodes


def _launcher(args) -> str:
    """launcher=auto follows the words given: a hostfile is mpirun's, torchrun's multi-node words
    (--nnodes, --node-rank, --master-addr, --max-restarts) are torchrun's; else the transport's."""
    if args.launcher != "auto":
        return args.launcher
    asked = args.backend  # the user's choice of transport (not a name a transport reports)
    if args.hostfile is not None or asked == "mpi":  # the MPI transport needs MPI's ranks
        return "mpirun"
    if launch.node_range(args.nnodes)[1] > 1 or args.node_rank or args.master_addr is not None or args.max_restarts:
        return "torchrun"
    return launch.default_launcher(args.device, args.backend)


def _spawn(args, nodes: launch.Nodes, argv) -> int:
    """Start this node's ranks of this command and wait for them. Ranks report their own
    errors (once per node); the launcher adds nothing but their exit code."""
    import uuid

    # one id for the whole job: the nodes' agents must agree on it (static rendezvous)
    run_id = os.environ.get("GRIDWEAVE_RUN_ID") or (uuid.uuid4().hex if nodes.nnodes == 1 else
                                                    f"gridweave-{nodes.master_addr}-{nodes.master_port}")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "GRIDWEAVE_SPAWNED": "1",
           "GRIDWEAVE_RUN_ID": run_id}
    os.environ.update(env)  # before mpirun's command, which forwards GRIDWEAVE_* to other nodes
    try:
        if _launcher(args) == "mpirun":  # quiet: no banner of its own when a rank fails; GRIDWEAVE_SPAWNED stops a respawn
            cmd = launch.mpirun_command(nodes.world_size, quiet=True, hostfile=args.hostfile,
                                        per_node=nodes.nproc if args.hostfile else None)
            # no stdin: mpirun forwards it, and stops in a background job that reads it
            return subprocess.call([*cmd, sys.executable, "-m", "gridweave.cli", *argv, "--backend", "mpi"],
                                   stdin=subprocess.DEVNULL, preexec_fn=launch.die_with_parent)
        return launch.torchrun(nodes, ["gridweave.cli", *argv], run_id, args.timeout)
    finally:
        import glob

        for marker in glob.glob(_reported_marker(run_id).rsplit("-", 1)[0] + "-*.reported"):  # every restart's
            os.unlink(marker)


def _train_rank(args) -> int:
    """One rank of `gridweave train`: an error ends it with one line on stderr, written by
    the first rank that meets it (the others' errors are its consequences)."""
    launch.die_with_parent()  # no orphan keeps training when its launcher dies
    cfg = train_config(args)
    recorded = []

    def record_config(step, state):  # the resolved configuration in the run folder, by rank 0, once
        if state.grid.rank == 0 and not recorded:
            g = state.grid
            ran_on = state.config if cfg.grid == AUTO else cfg  # grid auto: the grid it chose, as given
            resolved = dataclasses.replace(ran_on, dp=g.axes["dp"], pp=g.axes["pp"])
            ran = {"nproc": g.ranks_per_node, "nnodes": g.world_size // g.ranks_per_node}  # what ran, as launched
            if ran["nnodes"] > 1:
                ran.update(master_addr=os.environ.get("MASTER_ADDR"), master_port=launch._env_int("MASTER_PORT"))
            checkpoint.atomic_write(Path(cfg.out) / CONFIG_FILE,
                                    lambda t: Path(t).write_text(configfile.dump(resolved, ran)))
            recorded.append(step)

    try:
        train.run(cfg, on_step=record_config)
    except (GridError, CommError, Diverged, OSError) as e:
        run_id = os.environ.get("GRIDWEAVE_RUN_ID")  # set by our launcher, which removes the marker
        first = True  # under another launcher nobody coordinates: every rank says its line
        if run_id:
            try:
                os.close(os.open(_reported_marker(run_id),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                first = False
            except OSError:
                pass
        if first:
            rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
            print(f"gridweave train: rank {rank}: {type(e).__name__}: {as_flags(getattr(e, 'strerror', None) or e)}",
                  file=sys.stderr, flush=True)
        return 1
    return 0


def as_flags(message) -> str:
    """A library error in the command line's words: the library names TrainConfig's (and Nodes') fields
    (`dp=4`, `lr must be`) and mode objects (`Row(n=8)`); the command line says `--dp 4`,
    `--lr must be` and `row:8`."""
    message = str(message)
    for cls in modes.known():  # a mode object's repr -> its --tp spelling
        message = re.sub(rf"(?:\bgw\.)?\b{cls.__name__}\((?:\w+=)?(\d*)(?:, \w+=\w+)*\)",
                         lambda m, cls=cls: (cls(int(m.group(1))) if cls.size_arg else cls()).spec(), message)
    names = {name for section in SECTIONS for name in section.names()} | set(launch.Nodes.__dataclass_fields__)
    fields = "|".join(sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({fields})(=| must\b)",
                  lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(2) == "=" else " must"), message)


def train_config(args):
    """The parsed `train` command line as a gw.train.TrainConfig (the library takes no argparse)."""
    from dataclasses import fields


    names = {f.name for f in fields(TrainConfig) if f.init}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _explicit(parser, argv) -> set:
    """The destinations `argv` gives itself (not defaults): the flags that override a config file."""
    unset = object()
    saved = {a: a.default for a in parser._actions}
    try:
        for a in saved:
            a.default = unset
        given, _ = parser.parse_known_args(argv)
    finally:
        for a, d in saved.items():
            a.default = d
    return {k for k, v in vars(given).items() if v is not unset}


def with_config_file(args, parser, argv):
    """args with --config's values under the flags the command line gave itself."""
    if not args.config:
        return args
    fields, launch_values = configfile.load(args.config)
    explicit = _explicit(parser, argv)
    for k, v in {**fields, **launch_values}.items():
        if k not in explicit:
            setattr(args, k, v)
    return args


def launch_fields(args) -> dict:
    return {k: getattr(args, k) for k in configfile.LAUNCH}


def _parameters(model_cfg) -> int:
    """The model's parameters, counted on meta tensors (no memory)."""
    return sum(p.numel() for p in models.build(model_cfg, device="meta").parameters())


def grid_choice(rows: list) -> str:
    """grid auto's choice in words: the planner's first row, and why it ranks above the second
    (plan.explain)."""
    first = autogrid.plan_shape(rows[0])
    head = (f"grid auto: {first.spec()}, {rows[0]['microbatches']} micro-batches: {rows[0]['step_time_s'] * 1e3:.2f} "
            f"ms a step predicted, {rows[0]['memory_bytes'] / 2 ** 30:.2f} GiB a rank")
    folded = plan.fold_equal(rows)  # grids equal in time and memory but for a stage that changes nothing, as one
    if len(folded) < 2:
        return head + " (the only grid this world takes)"
    return head + "; why it ranks above the runner-up:\n  " + "\n  ".join(plan.explain(folded, 0))


def start_line(cfg, nodes, shape, launcher: str) -> str:
    """The job in one line, printed before its ranks start: launcher, ranks, grid, model, data, output."""
    params = _parameters(cfg.model_config(cfg.vocab))
    return (f"gridweave train: {launcher}, {nodes.world_size} rank(s) ({nodes.nnodes} node(s) x {nodes.nproc}) on "
            f"{cfg.device}; grid dp {shape['dp']} x pp {shape['pp']} x tp {cfg.mode.spec()} x sp {shape['sp']}; "
            f"model {cfg.model}, {params / 1e6:.2f} M parameters, {cfg.compute.name}; data "
            f"{cfg.data or 'the fortunes corpus'}, tokenizer {cfg.tokenizer}; output {cfg.out}")


def dry_run(cfg, nodes, shape) -> int:
    """The job on paper: the model built on meta tensors (no memory), its parameters, the grid
    and the planner's memory per rank; nothing starts."""
    model_cfg = cfg.model_config(cfg.vocab)
    params = _parameters(model_cfg)
    p = train.plan_job(cfg, shape, plan.load_cluster("local", nodes.nproc))
    mem = p["memory_breakdown_bytes"]
    print(f"model: {cfg.model}, {params:,} parameters ({params / 1e9:.2f} B), vocabulary {model_cfg.vocab}, "
          f"{cfg.compute.name}")
    print(f"grid: {nodes.world_size} ranks ({nodes.nnodes} x {nodes.nproc}): dp {shape['dp']} x pp {shape['pp']} x "
          f"tp {cfg.mode.spec()} x sp {shape['sp']}, placement {cfg.placement}")
    print(f"memory per rank (planner): {p['memory_bytes'] / 2 ** 30:.2f} GiB on the device ("
          + ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in mem.items()) + f"), {p['host_bytes'] / 2 ** 30:.2f} GiB "
          "in host memory")
    return 0


def parse_train(argv):
    """`gridweave train` flags -> TrainConfig, for scripts that drive the main job themselves."""
    ap = argparse.ArgumentParser(prog="gridweave train")
    sub = ap.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    return train_config(ap.parse_args(["train", *argv]))


if __name__ == "__main__":
    sys.exit(main())
