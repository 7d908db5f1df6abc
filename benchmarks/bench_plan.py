"""gw.plan against this machine: calibrate, then predict and measure a full training step of
the main job's model on every grid the 8 default ranks allow (issue 18).

    python benchmarks/bench_plan.py                   # writes results/plan_local.json and .png
    python benchmarks/bench_plan.py --transport mpi   # the main job's transport: plan_local_mpi.*

One job of 8 CPU ranks (torchrun and Gloo, or mpirun and MPI: the main job's transport where
gridweave has MPI). The ranks first calibrate (gridweave.calibrate.measure: alpha,
beta, GEMM rate, element-wise bandwidth, per-kernel cost, all ranks at once); then, for each
grid (every tensor mode, pp, dp, sp and their compositions; one host, so one placement),
build the main job's model exactly as `gridweave train` does (gw.train.build): for each
rank's peak resident memory over its resident memory before the model was built, over the
build and the warm-up steps (glibc's mmap threshold fixed, so freed tensors leave the
resident set: calibrate.resident_accounting), after a throwaway build and step (what the
process makes once per code path is not the model's), then afresh for the time of
gw.train.train_step (the median over steps of the slowest rank's step) with glibc reusing
freed memory as in any job (a fresh mapping per tensor made a step 9-13% slower; the
calibration runs that way too). The parent predicts
each grid from the calibrated preset alone (plan.predict), and asks the planner for its
ranking (plan.plan): the error of each prediction, the median and the worst, the measured
time of the planner's first choice against the fastest grid, and Kendall's tau between
the two rankings.
"""
from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

from launch import bench_parser, peak_growth_per_rank, results_dir, run_ranks, save, start_worker, stem

STEPS, WARMUP = 5, 2


def job_config(**grid):
    """The main job (gw.train.TrainConfig's defaults: Llama, hidden 128, 4 layers, batch 32 of
    128 tokens, 2 micro-batches, fp32) on one grid."""
    import gridweave as gw

    return gw.train.TrainConfig(**grid)


def planner_model():
    from gridweave import plan

    return plan.model_of(job_config())


def grids() -> list:
    """Every grid of 8 ranks the main job's model allows, as (dp, pp, tp spec, sp), each once: the
    planner enumerates a grid once per ZeRO stage, and the main job runs ZeRO 0."""
    import gridweave as gw
    from gridweave import plan

    out = []
    for g in plan.enumerate_grids(8, planner_model(), placements=("topology",)):
        try:
            job_config(dp=g.dp, pp=g.pp, tp=g.tp.spec(), sp=g.sp).grid_shape(8)
        except gw.GridError:
            continue
        if (g.dp, g.pp, g.tp.spec(), g.sp) not in out:
            out.append((g.dp, g.pp, g.tp.spec(), g.sp))
    return out


def worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import gridweave as gw
    from gridweave import calibrate

    n, rank, store = start_worker()
    world = gw.init(dp=n, store=store, prefix="plan-world")
    preset = calibrate.measure(world)  # glibc allocating as in any job
    rows = []

    def each_grid(tag: str, measure):
        """(grid, measure(build, step, drop)) for every grid: build() makes the main job's model
        on it as gridweave train does, step() runs and times one training step, drop() frees
        the model."""
        for i, (dp, pp, tp, sp) in enumerate(grids()):
            cfg = job_config(dp=dp, pp=pp, tp=tp, sp=sp)
            grid = gw.init(dp=dp, pp=pp, tp=cfg.mode, sp=sp, store=store, prefix=f"plan-{tag}-{i}")
            model_cfg = cfg.model_config(cfg.vocab)
            g = torch.Generator().manual_seed(grid.coords["dp"])
            x = torch.randint(0, model_cfg.vocab, (cfg.batch // dp, cfg.seq), generator=g)
            built = []

            def build():
                torch.manual_seed(cfg.seed)
                built[:] = gw.train.build(cfg, grid, model_cfg)[1:]  # the dense model is not kept

            def step():
                dist.barrier()
                t0 = time.perf_counter()
                gw.train.train_step(cfg, grid, *built, x, x.roll(1, 1))
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                return float(t)

            def drop():
                built.clear()
                gc.collect()

            yield (dp, pp, tp, sp), measure(build, step, drop)
            drop()
            grid.shutdown()

    def memory(build, step, drop):  # the build and the warm-up steps, glibc's mmap threshold fixed
        every = peak_growth_per_rank(build, step, drop, WARMUP)
        return {"measured_peak_bytes": max(every), "peak_bytes_per_rank": every}

    def timing(build, step, drop):  # glibc reusing freed memory, as in any job
        build()
        times = [step() for _ in range(WARMUP + STEPS)][WARMUP:]
        return {"measured_s": statistics.median(times), "steps_s": times}

    # Two passes: a fresh mapping per tensor (the fixed threshold) slows a step 9-13% here
    mem = dict(each_grid("memory", memory))
    for (dp, pp, tp, sp), t in each_grid("time", timing):
        rows.append({"dp": dp, "pp": pp, "tp": tp, "sp": sp, **t, **mem[(dp, pp, tp, sp)]})
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ranks": n, "backend": str(world.backend), "preset": preset,
                                              "rows": rows}, indent=1))
    gw.shutdown()
    dist.destroy_process_group()


def predict(data: dict) -> dict:
    """Each grid's prediction from the calibrated preset alone, and the planner's ranking."""
    from scipy.stats import kendalltau

    import gridweave as gw
    from gridweave import plan

    preset = data["preset"]
    cluster = plan.Cluster.of(preset)
    model = planner_model()
    cfg = job_config()
    for r in data["rows"]:
        shape = plan.GridShape(dp=r["dp"], pp=r["pp"], tp=gw.modes.parse(r["tp"]), sp=r["sp"])
        p = plan.predict(model, shape, cluster, microbatches=cfg.microbatches, **cfg.planned_optimizer())
        r["predicted_s"] = p["step_time_s"]
        r["error"] = p["step_time_s"] / r["measured_s"] - 1
        r["predicted_peak_bytes"] = p["memory_bytes"] + p["host_bytes"]
        r["memory_error"] = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
        r["breakdown_s"] = p["time_breakdown_s"]
    rows = data["rows"]
    key = lambda r: (r["dp"], r["pp"], r["tp"], r["sp"])  # noqa: E731
    measured = {key(r): r for r in rows}
    ranked = [key(r) for r in plan.plan(8, model, cluster, microbatches=cfg.microbatches, **cfg.planned_optimizer()) if key(r) in measured]
    first, fastest = measured[ranked[0]], min(rows, key=lambda r: r["measured_s"])
    tau = kendalltau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic
    errors = [abs(r["error"]) for r in rows]
    mem = [abs(r["memory_error"]) for r in rows]
    data["summary"] = {
        "grids": len(rows), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
        "worst_grid": key(max(rows, key=lambda r: abs(r["error"]))),
        "median_abs_memory_error": statistics.median(mem), "worst_abs_memory_error": max(mem),
        "planner_first": key(first), "planner_first_measured_s": first["measured_s"],
        "fastest": key(fastest), "fastest_measured_s": fastest["measured_s"],
        "first_over_fastest": first["measured_s"] / fastest["measured_s"], "kendall_tau": tau}
    return data


def name(r) -> str:
    parts = [f"dp{r['dp']}"] + ([f"pp{r['pp']}"] if r["pp"] > 1 else []) + \
        ([r["tp"].replace(":", "")] if r["tp"] != "none" else []) + ([f"sp{r['sp']}"] if r["sp"] > 1 else []) + \
        ([f"ep{r['ep']}"] if r.get("ep", 1) > 1 else [])
    return "·".join(parts)


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, s = data["rows"], data["summary"]
    fig, (ax, am) = plt.subplots(1, 2, figsize=(13, 6))
    for r in rows:
        first = (r["dp"], r["pp"], r["tp"], r["sp"]) == tuple(s["planner_first"])
        ax.scatter(r["measured_s"] * 1e3, r["predicted_s"] * 1e3, marker="*" if first else "o",
                   s=160 if first else 30, color="C3" if first else "C0")
        ax.annotate(name(r), (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=6)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.3
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.3
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="gray", alpha=0.2,
                    label="±15%")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms)",
           ylabel="predicted by gw.plan from the calibrated preset (ms)",
           title=f"main job, {s['grids']} grids of 8 CPU ranks: median |error| {100 * s['median_abs_error']:.0f}%, "
                 f"worst {100 * s['worst_abs_error']:.0f}%\nplanner's first (star) {s['first_over_fastest']:.2f}x "
                 f"the fastest; Kendall tau {s['kendall_tau']:.2f}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    mm = [(r["measured_peak_bytes"] / 2 ** 20, r["predicted_peak_bytes"] / 2 ** 20) for r in rows]
    am.scatter([a for a, _ in mm], [b for _, b in mm], s=20)
    lo, hi = min(min(p) for p in mm) / 1.3, max(max(p) for p in mm) * 1.3
    am.plot([lo, hi], [lo, hi], "k-", lw=1)
    am.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="gray", alpha=0.2)
    am.set(xscale="log", yscale="log", xlabel="measured peak RSS growth per rank (MiB)",
           ylabel="predicted peak memory per rank (MiB)",
           title=f"memory: median |error| {100 * s['median_abs_memory_error']:.0f}%, "
                 f"worst {100 * s['worst_abs_memory_error']:.0f}%")
    am.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--from-json", help="re-predict a saved run (no ranks)")
    args = ap.parse_args()
    if args.worker:
        worker(args.out)
        return
    out = results_dir(args)
    data = json.loads(Path(args.from_json).read_text()) if args.from_json else \
        run_ranks(__file__, 8, 29571, out, "8", transport=args.transport)
    data = predict(data)
    save(out, stem("plan_local", args.transport), data, plot)
    for r in sorted(data["rows"], key=lambda r: r["measured_s"]):
        print(f"{name(r):28s} measured {r['measured_s'] * 1e3:8.1f} ms  predicted {r['predicted_s'] * 1e3:8.1f} ms "
              f"({100 * r['error']:+5.0f}%)  memory {r['measured_peak_bytes'] / 2 ** 20:7.1f} MiB vs "
              f"{r['predicted_peak_bytes'] / 2 ** 20:7.1f} ({100 * r['memory_error']:+4.0f}%)")
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
