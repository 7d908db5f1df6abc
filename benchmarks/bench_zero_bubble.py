"""Zero-bubble pipelines (Qi et al., ICLR 2024: ZB-H1, ZB-V; DeepSeek-V3's DualPipe in a V) against
1F1B and interleaved 1F1B, in gridweave and in torch.distributed.pipelining, on CPU ranks.

    python benchmarks/bench_zero_bubble.py      # writes results/zero_bubble.json and .png

Each stage's work is emulated by sleeping: its forward T_F, its backward for the input T_B, its
weight gradient T_W (a hook on the stage's linear weight, which runs where its gradient is made:
in the backward of a whole-backward schedule, in W of a split one, gridweave's and torch's alike),
each 40 ms a stage, halved for each of two chunks: long beside what a message and an op's Python
cost on these cores (about a millisecond each), which would otherwise pass for bubble. How shared
cores are kept from hiding the bubble: a sleeping rank gives its core away, and a rank waiting for
a message sleeps too, so no rank's work is slowed by another's and none can run ahead on an idle
rank's core (as real compute on shared cores would); at pp 2 each rank is also pinned to a core of
its own. pp 2 and 4, m = p, 2p, 4p.

Measured per run: the step time (the slowest rank's, median of 5 steps after one warm-up); each
stage's idle fraction (1 - the work it ran over the step, the work timed inside the sleeps); for
gridweave's schedules the bubble from the engine's phases (the step's time blocked at a receive,
PipelineStats.wait_s, over the step: what the schedule left idle) and the rest of the idle time
(the ops' and messages' own costs); the same step with no work (every op's own host cost and its
messages: about 0.8 ms an op on these cores, gridweave's and torch's alike) and the idle fraction
net of it (idle less that step over the step: the bubble in the idle fraction once the ops' own
cost, which a GPU's queued kernels hide, is taken out); and each stage's peak activation memory:
the bytes of the stage's activations alive at once (each micro-batch's activation counted from
its forward until its weight gradient has used it; a chunk's as its share of the stage's layers,
half of two).
Beside them: the planner's predicted bubble (plan.bubble_fraction, as an idle fraction).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, start_worker, stem

T_MS = 40.0  # T_F = T_B = T_W a stage: long beside a message's and an op's milliseconds on shared cores
ROWS, H = 64, 64  # a micro-batch's activation: ROWS x H float32
STEPS = 5


class Meter:
    """The work a rank ran (seconds inside the sleeps) and its activations' bytes alive, now and at most."""

    def __init__(self):
        self.busy = 0.0
        self.live = self.peak = 0

    def sleep(self, ms):
        t0 = time.perf_counter()
        time.sleep(ms / 1e3)
        self.busy += time.perf_counter() - t0

    def track(self, t, share=1.0):
        """t alive until it goes: a stage's activation, times the share of the stage's layers its chunk holds."""
        n = int(t.numel() * t.element_size() * share)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)

    def _free(self, n):
        self.live -= n


def _chunk(meter, t_ms, share):
    """One chunk of a stage: Work (forward T_F, backward for its input T_B) then a linear whose
    weight's gradient costs T_W (a hook on it), each t_ms (a stage's time times the chunk's share
    of its layers, as its activation's bytes)."""
    import torch

    class Work(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            meter.sleep(t_ms)
            y = x * 1.0
            meter.track(y, share)  # the activation the linear keeps for its weight gradient: a chunk's share
            return y

        @staticmethod
        def backward(ctx, g):
            meter.sleep(t_ms)
            return g

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # the first stage's B costs T_B too: its input (as a model's embedding output) has a gradient
            self.shift = torch.nn.Parameter(torch.zeros(()))
            self.lin = torch.nn.Linear(H, H, bias=False)
            torch.nn.init.eye_(self.lin.weight)
            # a tensor hook: it runs where the weight's gradient is made, by torch's autograd.grad in
            # its W (stage_backward_weight assigns .grad itself: no post-accumulate hook runs there)
            self.lin.weight.register_hook(lambda g: meter.sleep(t_ms))

        def forward(self, x):
            return self.lin(Work.apply(x + self.shift))

    return Chunk()


GW = ("1f1b", "interleaved", "zb1", "zbv", "dualpipev")
TORCH = ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
CHUNKS = {"1f1b": 1, "interleaved": 2, "zb1": 1, "zbv": 2, "dualpipev": 2, "Schedule1F1B": 1,
          "ScheduleInterleavedZeroBubble": 2, "ScheduleZBVZeroBubble": 2, "ScheduleDualPipeV": 2}
V = ("zbv", "dualpipev", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _gather(t):
    import torch
    import torch.distributed as dist

    every = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return every


def worker(part, out_path):
    import torch.distributed as dist

    import gridweave as gw
    from gridweave import plan

    n, rank, store = start_worker()
    cores = sorted(os.sched_getaffinity(0))
    if n <= len(cores):  # a core of its own
        os.sched_setaffinity(0, {cores[rank]})
    grid = gw.init(pp=n, store=store, prefix="zb")
    s = grid.coords["pp"]
    runs = {}
    for m in (n, 2 * n, 4 * n):
        for name in GW + TORCH:
            v = CHUNKS[name]
            if name in ("dualpipev", "ScheduleDualPipeV") and m < 2 * n:
                continue  # DualPipeV needs 2p micro-batches
            if rank == 0:
                print(f"zero_bubble pp{n}: {name} m={m}", file=sys.stderr, flush=True)
            try:
                times, busy, peak, waits = _measure(gw, grid, name, s, n, m, T_MS)
                bare = statistics.median(_measure(gw, grid, name, s, n, m, 0.0)[0])  # the ops' own cost alone
            except Exception as e:  # a schedule this torch refuses at these sizes: said in the results
                runs[f"{name}_m{m}"] = {"schedule": name, "microbatches": m, "error": f"{type(e).__name__}: {e}"}
                dist.barrier()
                continue
            step_s = statistics.median(times)
            idle = [1 - statistics.median(b[k] for b in busy) / step_s for k in range(n)]
            row = {"schedule": name, "library": "gridweave" if name in GW else "torch", "microbatches": m,
                   "chunks": v, "step_s": step_s, "idle_fraction": idle, "bubble": statistics.mean(idle),
                   "bare_step_s": bare, "net_bubble": statistics.mean(idle) - bare / step_s,
                   "peak_activation_bytes": [max(p[k] for p in peak) for k in range(n)],
                   "microbatch_activation_bytes": ROWS * H * 4}
            if name in GW:
                b = plan.bubble_fraction(n, m, name, v)  # idle over busy
                row["predicted_bubble"] = b / (1 + b)
                row["wait_fraction"] = [statistics.median(w[k] for w in waits) for k in range(n)]
                row["measured_bubble"] = statistics.mean(row["wait_fraction"])  # from the phases
                row["overhead"] = row["bubble"] - row["measured_bubble"]  # idle neither working nor waiting
            runs[f"{name}_m{m}"] = row
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ranks": n, "t_ms": T_MS, "runs": runs}))
    gw.shutdown()
    dist.destroy_process_group()


def _measure(gw, grid, name, s, n, m, t_ms):
    """STEPS steps (after a warm-up) of schedule `name` on chunks whose ops take t_ms a stage: each
    step's (slowest rank's time, each rank's work, peak activation bytes, wait fraction)."""
    import torch
    import torch.distributed as dist

    v = CHUNKS[name]
    meter = Meter()
    chunks = [_chunk(meter, t_ms / v, 1 / v) for _ in range(v)]
    xs = [torch.ones(ROWS, H) for _ in range(m)]
    times, busy, peak, waits = [], [], [], []
    if name in GW:
        stage = chunks if v > 1 else chunks[0]  # a V's chunks: chunk 1 is virtual stage 2p - 1 - s

        def step():
            return gw.pipeline.pipeline_step(stage, grid, xs, xs, lambda o, t: (o * t).sum(), (ROWS, H),
                                             schedule=name, microbatches=m)[1].wait_s
    else:
        step = _torch_schedule(name, chunks, s, n, m)
    for rep in range(STEPS + 1):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        meter.busy, meter.peak = 0.0, meter.live
        dist.barrier()
        t0 = time.perf_counter()
        wait = step() or 0.0
        dt = time.perf_counter() - t0
        every = _gather(torch.tensor([dt, meter.busy, float(meter.peak), wait], dtype=torch.float64))
        if rep:  # the first is a warm-up
            span = max(float(e[0]) for e in every)
            times.append(span)
            busy.append([float(e[1]) for e in every])
            peak.append([float(e[2]) for e in every])
            waits.append([float(e[3]) / span for e in every])
    return times, busy, peak, waits


def _torch_schedule(name, chunks, s, n, m):
    """torch.distributed.pipelining's schedule `name` over the same chunks: stage indices s (and
    s + n looped, or 2n - 1 - s in a V); step() runs one batch of m micro-batches."""
    import torch
    import torch.distributed.pipelining as pipelining

    v = len(chunks)
    if v == 1:
        index = [s]
    elif name in V:
        index = [s, 2 * n - 1 - s]
    else:
        index = [s, s + n]
    stages = [pipelining.PipelineStage(c, i, n * v, torch.device("cpu")) for c, i in zip(chunks, index)]
    cls = getattr(pipelining, name)
    loss = lambda o, t: (o * t).sum()  # noqa: E731
    sched = cls(stages[0], m, loss_fn=loss, scale_grads=False) if v == 1 else \
        cls(stages, m, loss_fn=loss, scale_grads=False)
    first, last = 0 in index, n * v - 1 in index
    x = torch.ones(m * ROWS, H)

    def step():
        args = (x,) if first else ()
        kw = {"target": x, "losses": []} if last else {}
        sched.step(*args, **kw)  # no phases to read: None
    return step


def run(n, out, transport):
    return run_ranks(__file__, n, 29571 + n, out, f"zb{n}", "zb", transport=transport)


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 8))
    for col, key in enumerate(("pp2", "pp4")):
        runs = data[key]["runs"]
        ms = sorted({r["microbatches"] for r in runs.values()})
        for ax, field, title, libs in ((axes[0][col], "bubble", "idle fraction a stage (mean)", GW + TORCH),
                                       (axes[1][col], "net_bubble", "idle net of the ops' own cost (bars), "
                                        "predicted (dots)", GW + TORCH)):
            names = [n for n in libs if any(r.get("schedule") == n and field in r for r in runs.values())]
            width = 0.8 / max(len(names), 1)
            for i, name in enumerate(names):
                got = [runs.get(f"{name}_m{m}", {}) for m in ms]
                xs = [j + i * width for j in range(len(ms))]
                bars = ax.bar(xs, [r.get(field, float("nan")) for r in got], width, label=name)
                if field == "net_bubble" and name in GW:
                    ax.plot(xs, [r.get("predicted_bubble", float("nan")) for r in got], "o", ms=4,
                            color=bars.patches[0].get_facecolor(), markeredgecolor="black")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ms))], [f"m={m}" for m in ms])
            ax.set(title=f"{key}: {title}", ylabel="fraction of the step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = bench_parser(__file__, ("zb",))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    out = results_dir(args)
    data = {"pp2": run(2, out, args.transport), "pp4": run(4, out, args.transport)}
    for key in ("pp2", "pp4"):
        one = {r["microbatches"]: r for r in data[key]["runs"].values() if r.get("schedule") == "1f1b"}
        for r in data[key]["runs"].values():
            if "error" in r:
                continue
            base = one[r["microbatches"]]
            r["bubble_over_1f1b"] = r["bubble"] / base["bubble"] if base["bubble"] > 0 else None
            r["net_bubble_over_1f1b"] = r["net_bubble"] / base["net_bubble"] if base["net_bubble"] > 0 else None
            if "measured_bubble" in r:
                r["measured_bubble_over_1f1b"] = r["measured_bubble"] / base["measured_bubble"] \
                    if base["measured_bubble"] > 0 else None
                r["predicted_over_1f1b"] = r["predicted_bubble"] / base["predicted_bubble"]
            r["peak_over_1f1b"] = max(r["peak_activation_bytes"]) / max(base["peak_activation_bytes"])
    save(out, stem("zero_bubble", args.transport), data, plot)
    for key in ("pp2", "pp4"):
        for k, r in data[key]["runs"].items():
            if "error" in r:
                print(f"{key} {k:38s} {r['error'][:90]}")
                continue
            print(f"{key} {k:38s} step {r['step_s'] * 1e3:7.1f} ms idle {r['bubble']:.3f} "
                  f"(/1F1B {r['bubble_over_1f1b'] or 0:.2f}) bubble {r.get('measured_bubble', float('nan')):.3f} "
                  f"(/1F1B {r.get('measured_bubble_over_1f1b') or float('nan'):.2f}) "
                  f"net {r['net_bubble']:.3f} (/1F1B {r['net_bubble_over_1f1b'] or float('nan'):.2f}) "
                  f"predicted {r.get('predicted_bubble', float('nan')):.3f} "
                  f"peak act {max(r['peak_activation_bytes']) / r['microbatch_activation_bytes']:.1f} mb "
                  f"(/1F1B {r['peak_over_1f1b']:.2f})")


if __name__ == "__main__":
    main()
