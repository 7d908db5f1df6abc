"""AxoNN (AxoNN) on CPU ranks.

    python benchmarks/bench_pipeline.py      # writes results/pipeline.json and .png

imbalance: 4 stages whose per-microbatch forward/backward times vary (seeded, 0.5x-2x),
  message-driven (Algorithm 2) vs 1F1B with flush; step time.
bubble: balanced stages, measured idle fraction of a step vs (p-1)/m and (p-1)/(m+p-1)
  for m = 4, 8, 16 microbatches; and Megatron's interleaved schedule (Megatron-LM Fig. 4) with
  v = 2 model chunks per stage (each half the stage's work): bubble (p-1)/(v m), idle
  fraction (p-1)/(v m + p - 1).
Stage compute is emulated by sleeping (1 ms forward, 2 ms backward per microbatch) so the
schedules, not 2 shared cores, decide the timing.
overlap: OffloadAdam.step on 8 data-parallel ranks (all-reduce in chunks of k x bsize
  overlapped with the bucketed optimizer) for k = 1, 2, 4, 8 and one single chunk.
"""
from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, start_worker, stem

F_MS, B_MS = 1.0, 2.0


def _sleeper(stage, jitter, scale=1.0):
    import torch

    class Work(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mb):
            ctx.mb = mb
            time.sleep(scale * F_MS / 1e3 * jitter(stage, mb, 0))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(scale * B_MS / 1e3 * jitter(stage, ctx.mb, 1))
            return g.clone(), None

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.mb = 0

        def forward(self, x):
            y = Work.apply(x * self.w, self.mb)
            self.mb += 1
            return y

    return Stage()


def worker(part, out_path):
    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    result = {"ranks": n}
    if part in ("imbalance", "bubble"):
        grid = gw.init(pp=n, store=store, prefix=f"pp-{part}")
        s = grid.coords["pp"]

        def jitter_fn(seed):
            def jitter(stage, mb, kind):
                if part == "bubble":
                    return 1.0
                return random.Random(seed * 1000003 + stage * 1009 + mb * 7 + kind).uniform(0.5, 2.0)
            return jitter

        shape = (1, 4)
        runs = {}
        configs = [(m, sched) for m in ((8,) if part == "imbalance" else (4, 8, 16))
                   for sched in (("message_driven", "1f1b") if part == "imbalance" else
                                 ("message_driven", "1f1b", "interleaved"))]
        v = 2  # model chunks per stage of the interleaved schedule
        for m, sched in configs:
            times, idle = [], []
            for rep in range(5):
                stage = [_sleeper(s, jitter_fn(rep), 1.0 / v) for _ in range(v)] if sched == "interleaved" \
                    else _sleeper(s, jitter_fn(rep))
                xs = [torch.ones(shape) for _ in range(m)]
                ys = [torch.ones(shape) for _ in range(m)]
                dist.barrier()
                t0 = time.perf_counter()
                _, st = gw.pipeline.pipeline_step(stage, grid, xs, ys, lambda o, t: (o * t).sum(), shape,
                                                  schedule=sched, pipeline_limit=n)
                dt = time.perf_counter() - t0
                t = torch.tensor([dt, st.compute_s], dtype=torch.float64)
                all_t = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
                dist.all_gather(all_t, t)
                times.append(max(float(a[0]) for a in all_t))
                idle.append(statistics.mean(1 - float(a[1]) / max(float(a[0]) for a in all_t) for a in all_t))
            vm = v * m if sched == "interleaved" else m  # the interleaved bubble is (p-1)/(v m)
            runs[f"{sched}/m={m}"] = {"schedule": sched, "microbatches": m, "step_s": statistics.median(times),
                                      "idle_fraction": statistics.median(idle), "chunks": v if vm != m else 1,
                                      "model_(p-1)/m": (n - 1) / vm, "model_(p-1)/(m+p-1)": (n - 1) / (vm + n - 1)}
        result["runs"] = runs
    else:  # overlap of the chunked all-reduce with the optimizer
        grid = gw.init(dp=n, store=store, prefix="pp-overlap")
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(32)]  # 2M parameters
        bsize = 1 << 16
        out = {}
        for k in (1, 2, 4, 8, 32):
            opt = gw.optim.OffloadAdam(params, bsize=bsize, coarsening=k, grid=grid)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            ts = []
            for _ in range(5):
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                ts.append(time.perf_counter() - t0)
            out[k] = statistics.median(ts)
        result["optimizer_step_s"] = out
        result["bsize"] = bsize
        result["parameters"] = sum(p.numel() for p in params)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    gw.shutdown()
    dist.destroy_process_group()


def run(part, n, out, transport):
    return run_ranks(__file__, n, 29559, out, part, part, transport=transport)


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    r = data["imbalance"]["runs"]
    axes[0].bar(list(r), [v["step_s"] * 1e3 for v in r.values()])
    axes[0].set(title="4 stages, 8 microbatches, jittered stage times", ylabel="step ms")
    b = data["bubble"]["runs"]
    for sched, mk in (("message_driven", "o-"), ("1f1b", "s-"), ("interleaved", "^-")):
        pts = sorted((v["microbatches"], v["idle_fraction"]) for v in b.values() if v["schedule"] == sched)
        axes[1].plot([m for m, _ in pts], [f for _, f in pts], mk, label=f"measured {sched}")
    ms = sorted({v["microbatches"] for v in b.values()})
    p = data["bubble"]["ranks"]
    axes[1].plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", lw=1, label="(p-1)/(m+p-1)")
    axes[1].plot(ms, [(p - 1) / (2 * m + p - 1) for m in ms], "g--", lw=1, label="interleaved v=2: (p-1)/(vm+p-1)")
    axes[1].plot(ms, [(p - 1) / m for m in ms], "k:", lw=1, label="(p-1)/m")
    axes[1].set(title=f"idle fraction, p={p} balanced stages", xlabel="microbatches m", ylabel="fraction")
    axes[1].legend()
    o = data["overlap"]["optimizer_step_s"]
    ks = sorted(o, key=int)
    axes[2].plot([int(k) for k in ks], [o[k] * 1e3 for k in ks], "o-")
    axes[2].set(xscale="log", title="all-reduce + optimizer, 8 ranks, 2M params", xlabel="coarsening k",
                ylabel="ms")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = bench_parser(__file__, ("imbalance", "bubble", "overlap"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    out = results_dir(args)
    t = args.transport
    data = {"imbalance": run("imbalance", 4, out, t), "bubble": run("bubble", 4, out, t),
            "overlap": run("overlap", 8, out, t)}
    save(out, stem("pipeline", t), data, plot)
    for part in ("imbalance", "bubble"):
        for k, v in data[part]["runs"].items():
            print(f"{part:9s} {k:22s} step {v['step_s'] * 1e3:7.1f} ms idle {v['idle_fraction']:.3f} "
                  f"(p-1)/m {v['model_(p-1)/m']:.3f} (p-1)/(m+p-1) {v['model_(p-1)/(m+p-1)']:.3f}")
    print("overlap  ", {k: f"{v * 1e3:.1f} ms" for k, v in data["overlap"]["optimizer_step_s"].items()})


if __name__ == "__main__":
    main()
