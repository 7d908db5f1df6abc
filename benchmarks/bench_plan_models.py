"""gw.plan off its training ground: calibrate once, then measure a
full training step of several model shapes unlike the main job's on every grid of 8 ranks that
`gridweave train` accepts, and compare each with the planner's prediction.

    python benchmarks/bench_plan_models.py                  # writes results/plan_models.json and .png
    python benchmarks/bench_plan_models.py --from-json F    # re-predict a saved run (no ranks)

One job of 8 CPU ranks (torchrun, Gloo). The ranks calibrate once (gridweave.calibrate.measure,
what `gridweave bench --calibrate` writes); then for each model and each grid they build the
model as `gridweave train` does (gw.train.build) and time gw.train.train_step (the median over
steps of the slowest rank's step; each shape's grids in two rounds, forward then backward through
them, each grid built afresh, so the host's drift over a shape's minutes falls on all alike). The
parent predicts every grid from the calibrated preset alone (plan.predict at the job's micro-batch count, OffloadAdam as train builds it) and reports,
per model and over the models: median and worst |error|, Kendall's tau between predicted and
measured times, and the regret of the planner's first choice (its measured time over the
fastest grid's). The models are split before anything is looked at: FIT holds the shapes any
term of the model may be tuned on (the main job's, and one more); every other shape is
reported only.

    python benchmarks/bench_plan_models.py --draw SEED      # fresh shapes: results/plan_models_draw<SEED>.json

--draw replaces the fixed shapes by SHAPES drawn at random from the seed (recorded in the result):
hidden 32-512, 2-12 layers, heads and key/value heads, sequence 32-1024, global batch 4-64, 1-8
micro-batches, Llama, GPT and Mixtral, a step's work kept within what 8 ranks on 2 cores time in
seconds. A drawn shape is never in FIT: the planner's terms never see it. With --draw the ranks
calibrate before each shape and once after the last, and each shape is predicted from the two
calibrations either side of it (calibrate.combine): the host's speed drifts (its GEMM rate 26.7
GFLOP/s at one calibration, 19.2 an hour later; the collectives' share of a step 60% slower than
half an hour before), and a shape's grids are timed within minutes of each other.
"""
from __future__ import annotations

import gc
import json
import math
import random
import statistics
import time
from pathlib import Path

from bench_plan import name as label
from launch import bench_parser, results_dir, run_ranks, save, start_worker, stem

# each grid is built and timed in ROUNDS (STEPS timed steps after WARMUP each: the first step after
# a build took 1.4-2.2x a steady one; the second and third ran alike, their ratio's median over
# two draws' grids 0.99-1.03)
STEPS, WARMUP, ROUNDS = 2, 1, 2

# name -> TrainConfig fields. Narrow and wide, shallow and deep, short and long sequences, small
# and large batches, Llama with grouped key/value heads and GPT without them.
MODELS = {
    "main": {},  # the main job's (hidden 128, 8 heads, 4 layers, sequence 128, batch 32 in 2)
    "gpt-mid": dict(model="gpt", hidden=192, heads=6, layers=6, seq=96, batch=24, microbatches=3),
    "narrow": dict(hidden=64, heads=4, kv_heads=2, layers=4, seq=64, batch=16),
    "wide": dict(hidden=512, heads=8, layers=2, seq=64, batch=16),
    "deep": dict(model="gpt", hidden=96, heads=6, layers=16, seq=64, batch=16, microbatches=4),
    "long": dict(hidden=128, heads=4, layers=2, seq=1024, batch=8),
    "big-batch": dict(hidden=128, heads=8, kv_heads=2, layers=4, seq=32, batch=128, microbatches=8),
    "small-batch": dict(model="gpt", hidden=256, heads=8, layers=4, seq=128, batch=8, microbatches=1),
    # issue 35: a mixture of experts (8 experts of 192, top-2), every expert-parallel degree
    "mixtral": dict(model="mixtral", hidden=96, heads=4, kv_heads=2, layers=2, seq=64, batch=16, experts=8,
                    moe_ffn=192),
}
FIT = ("main", "gpt-mid")  # the only shapes a term of the model may be tuned on
# A drawn step's floating-point work at most (6 N tokens + attention's 12 L s^2 h b): at most a
# few seconds a step for the whole job of 8 ranks on 2 cores. The first draw (seed 1) took 3e10
# and 36 minutes for 79 grids; 1e10 keeps a draw near a quarter of an hour.
DRAW_FLOPS = 1e10
# What the planner must hold on shapes it never saw, over every drawn grid (the regret: each
# shape's first choice against its fastest measured grid; tau: the median over the shapes).
GOALS = {"median_abs_error": 0.15, "worst_abs_error": 0.35, "worst_regret": 0.10, "median_kendall_tau": 0.8}
def goals_met(scores: dict) -> dict:
    """Each of GOALS against `scores` (their keys): tau at least its goal, the others at most."""
    return {k: bool(scores[k] >= goal if k == "median_kendall_tau" else scores[k] <= goal) for k, goal in GOALS.items()}


DRAW_MIN_GRIDS = 8  # a shape fewer grids accept says little about the ranking


def log_uniform(rng: random.Random, lo: int, hi: int, step: int = 1) -> int:
    return max(lo, min(hi, step * round(math.exp(rng.uniform(math.log(lo), math.log(hi))) / step)))


def step_flops(f: dict) -> float:
    """The step's work in the dense-model terms (forward and backward: 6 per parameter and token)."""
    h, layers, s, b = f["hidden"], f["layers"], f["seq"], f["batch"]
    ffn = f.get("moe_ffn", 0) * f.get("top_k", 0) * 3 or 8 * h  # SwiGLU's three matrices, GPT's two of 4h
    block = 4 * h * h + ffn * h
    return 6 * (layers * block + 2 * 1024 * h) * s * b + 12 * layers * s * s * h * b


def draw(seed: int, count: int) -> dict:
    """count shapes drawn from seed: the last a mixture of experts, the others Llama or GPT."""
    import gridweave as gw

    rng = random.Random(seed)
    out = {}
    while len(out) < count:
        kind = "mixtral" if len(out) == count - 1 else rng.choice(("llama", "gpt"))
        hidden = log_uniform(rng, 32, 512, 8)
        heads = rng.choice([d for d in (1, 2, 4, 8, 16) if hidden % d == 0 and hidden // d >= 8])
        f = dict(model=kind, hidden=hidden, heads=heads, layers=rng.randint(2, 12), seq=log_uniform(rng, 32, 1024, 16))
        if kind != "gpt":
            f["kv_heads"] = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
        m = rng.randint(1, 8)
        f["microbatches"], f["batch"] = m, m * rng.choice([k for k in range(1, 65) if 4 <= m * k <= 64])
        if kind == "mixtral":
            f.update(experts=rng.choice((4, 8)), top_k=rng.choice((1, 2)), moe_ffn=log_uniform(rng, hidden // 2, 4 * hidden, 8))
        if step_flops(f) > DRAW_FLOPS:
            continue
        name = f"{kind}-{len(out)}"
        MODELS[name] = f
        try:
            accepted = len(grids(name))
        except gw.GridError:
            accepted = 0
        if accepted < DRAW_MIN_GRIDS:
            del MODELS[name]
            continue
        out[name] = f
    return out


def job_config(name: str, **grid):
    import gridweave as gw

    return gw.train.TrainConfig(**MODELS[name], **grid)


def grids(name: str) -> list:
    """Every grid of 8 ranks `gridweave train` accepts for the model at ZeRO 0 (its default), as
    (dp, pp, tp spec, sp, ep): the planner's enumeration without its floor of tokens per sequence rank,
    each grid checked by train's own TrainConfig.grid_shape."""
    import gridweave as gw
    from gridweave import plan

    out = []
    model = plan.model_of(job_config(name))
    for g in plan.enumerate_grids(8, model, placements=("topology",), zeros=(0,), min_sp_tokens=1):
        try:
            job_config(name, dp=g.dp, pp=g.pp, tp=g.tp.spec(), sp=g.sp, ep=g.ep).grid_shape(8)
        except gw.GridError:
            continue
        out.append((g.dp, g.pp, g.tp.spec(), g.sp, g.ep))
    return out


def timed_steps(name: str, i: int, round_: int, dp: int, pp: int, tp: str, sp: int, ep: int, store) -> list:
    """STEPS timed training steps (after WARMUP) of model `name` on a grid built for them, as
    gridweave train builds it: each the slowest rank's."""
    import torch
    import torch.distributed as dist

    import gridweave as gw

    cfg = job_config(name, dp=dp, pp=pp, tp=tp, sp=sp, ep=ep)
    grid = gw.init(dp=dp, pp=pp, tp=cfg.mode, sp=sp, store=store, prefix=f"planm-{name}-{i}-{round_}")
    model_cfg = cfg.model_config(cfg.vocab)
    g = torch.Generator().manual_seed(grid.coords["dp"])
    x = torch.randint(0, model_cfg.vocab, (cfg.batch // dp, cfg.seq), generator=g)
    torch.manual_seed(cfg.seed)
    built = gw.train.build(cfg, grid, model_cfg)[1:]  # the dense model is not kept
    times = []
    for _ in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        gw.train.train_step(cfg, grid, *built, x, x.roll(1, 1))
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        times.append(float(t))
    del built
    gc.collect()
    grid.shutdown()
    return times[WARMUP:]


def worker(out_path: str, names: list, drawn: bool) -> None:
    import torch.distributed as dist

    import gridweave as gw
    from gridweave import calibrate

    n, rank, store = start_worker()
    world = gw.init(dp=n, store=store, prefix="planm-world")
    preset = calibrate.measure(world)
    rows, presets, calibrations = [], {}, [preset]

    def write():
        if rank == 0:  # what is measured so far survives an interrupted run
            Path(out_path).write_text(json.dumps({"ranks": n, "backend": str(world.backend), "preset": presets.get(names[0], preset),
                                                  "presets": presets, "calibrations": calibrations,
                                                  "models": {k: MODELS[k] for k in names}, "fit": FIT,
                                                  "rows": rows}, indent=1))

    for k, name in enumerate(names):
        if drawn:  # the host's speed drifts: each shape between calibrations of its own
            if k:  # (the first shape's first is the one just made)
                calibrations.append(calibrate.measure(world, prefix=f"calibrate-{name}"))
                presets[names[k - 1]] = calibrate.combine(calibrations[-2:])  # the calibrations either side of it
            presets[name] = calibrations[-1]
        shape_grids = list(enumerate(grids(name)))
        times = {i: [] for i, _ in shape_grids}
        # in ROUNDS, forward then backward through the grids: a host whose speed drifts over the
        # minutes a shape takes then slows its first and last grids alike (timed one after the
        # other and re-measured, a shape's grids moved by up to 73% against the shape's median)
        for round_ in range(ROUNDS):
            for i, (dp, pp, tp, sp, ep) in (shape_grids if round_ % 2 == 0 else shape_grids[::-1]):
                times[i] += timed_steps(name, i, round_, dp, pp, tp, sp, ep, store)
        for i, (dp, pp, tp, sp, ep) in shape_grids:
            rows.append({"model": name, "dp": dp, "pp": pp, "tp": tp, "sp": sp, "ep": ep,
                         "measured_s": statistics.median(times[i]), "steps_s": times[i]})
        write()
    if drawn:  # the last shape's calibrations either side of it too
        calibrations.append(calibrate.measure(world, prefix="calibrate-after"))
        presets[names[-1]] = calibrate.combine(calibrations[-2:])
        write()
    gw.shutdown()
    dist.destroy_process_group()


def predict(data: dict) -> dict:
    """Each grid's prediction from the calibrated preset alone; per model and overall: median
    and worst |error|, Kendall's tau, and the regret of the first choice (the measured grid the
    planner ranks first: the fastest predicted at the job's micro-batch count)."""
    from scipy.stats import kendalltau

    import gridweave as gw
    from gridweave import plan

    summary = {}
    for name in data["models"]:
        rows = [r for r in data["rows"] if r["model"] == name]
        if not rows:
            continue
        cluster = plan.Cluster.of(data.get("presets", {}).get(name, data["preset"]))
        cfg = job_config(name)
        model = plan.model_of(cfg)
        for r in rows:
            shape = plan.GridShape(dp=r["dp"], pp=r["pp"], tp=gw.modes.parse(r["tp"]), sp=r["sp"], ep=r.get("ep", 1))
            p = plan.predict(model, shape, cluster, microbatches=cfg.microbatches, **cfg.planned_optimizer())
            r["predicted_s"] = p["step_time_s"]
            r["error"] = p["step_time_s"] / r["measured_s"] - 1
            r["breakdown_s"] = p["time_breakdown_s"]
        first = min(rows, key=lambda r: r["predicted_s"])
        fastest = min(rows, key=lambda r: r["measured_s"])
        errors = [abs(r["error"]) for r in rows]
        summary[name] = {
            "fit": name in data["fit"], "grids": len(rows),
            "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
            "worst_grid": label(max(rows, key=lambda r: abs(r["error"]))),
            "kendall_tau": kendalltau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic
            if len(rows) > 1 else 1.0,
            "planner_first": label(first), "fastest": label(fastest),
            "regret": first["measured_s"] / fastest["measured_s"] - 1}
    reported = [r for r in data["rows"] if r["model"] not in data["fit"] and "error" in r]
    per = [s for s in summary.values() if not s["fit"]]
    if reported:
        summary["reported"] = {
            "models": len(per), "grids": len(reported),
            "median_abs_error": statistics.median(abs(r["error"]) for r in reported),
            "worst_abs_error": max(abs(r["error"]) for r in reported),
            "median_kendall_tau": statistics.median(s["kendall_tau"] for s in per),
            "worst_regret": max(s["regret"] for s in per),
            "min_kendall_tau": min(s["kendall_tau"] for s in per)}
        summary["goals_met"] = goals_met(summary["reported"])
    data["summary"] = summary
    return data


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in data["models"] if k in data["summary"]]
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(4 * ((len(names) + 1) // 2), 8.5))
    for ax, name in zip(axes.flat, names):
        rows, s = [r for r in data["rows"] if r["model"] == name], data["summary"][name]
        for r in rows:
            first = label(r) == s["planner_first"]
            ax.scatter(r["measured_s"] * 1e3, r["predicted_s"] * 1e3, marker="*" if first else "o",
                       s=140 if first else 20, color="C3" if first else ("C1" if s["fit"] else "C0"))
            ax.annotate(label(r), (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=5)
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
        ax.plot([lo, hi], [lo, hi], "k-", lw=1)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="gray", alpha=0.2)
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms)",
               ylabel="predicted (ms)")
        ax.set_title(f"{name}{' (fit)' if s['fit'] else ''}: {s['grids']} grids, median |err| "
                     f"{100 * s['median_abs_error']:.0f}%, worst {100 * s['worst_abs_error']:.0f}%\n"
                     f"tau {s['kendall_tau']:.2f}, first choice (star) regret {100 * s['regret']:.0f}%", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    r = data["summary"].get("reported")
    if r:
        fig.suptitle(f"gw.plan on {r['models']} model shapes it was not fitted to ({r['grids']} grids of 8 CPU ranks): "
                     f"median |error| {100 * r['median_abs_error']:.0f}%, worst {100 * r['worst_abs_error']:.0f}%, "
                     f"worst regret {100 * r['worst_regret']:.0f}%", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--from-json", help="re-predict a saved run (no ranks)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names of MODELS")
    ap.add_argument("--draw", type=int, help="time SHAPES shapes drawn at random from this seed instead")
    ap.add_argument("--shapes", type=int, default=5, help="with --draw: how many (the last a mixture of experts)")
    args = ap.parse_args()
    drawn = draw(args.draw, args.shapes) if args.draw is not None else None
    if drawn is not None:
        MODELS.clear()
        MODELS.update(drawn)
    names = list(drawn) if drawn is not None else [m for m in args.models.split(",") if m]
    if args.worker:
        worker(args.out, names, drawn is not None)
        return
    out = results_dir(args)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        MODELS.update(data["models"])
    else:
        extra = ("--draw", str(args.draw), "--shapes", str(args.shapes)) if drawn is not None else ()
        data = run_ranks(__file__, 8, 29581, out, "8", "--models", ",".join(names), *extra, transport=args.transport)
        if drawn is not None:
            data["draw"] = {"seed": args.draw, "shapes": args.shapes, "flops_cap": DRAW_FLOPS}
    data = predict(data)
    name = f"plan_models_draw{data['draw']['seed']}" if "draw" in data else "plan_models"
    save(out, stem(name, args.transport), data, plot)
    for r in data["rows"]:
        print(f"{r['model']:12s} {label(r):24s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
              f"{r['predicted_s'] * 1e3:8.1f} ms ({100 * r['error']:+5.0f}%)")
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
