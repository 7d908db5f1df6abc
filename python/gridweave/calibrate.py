"""`gridweave bench --calibrate`: measure this machine's alpha (latency per message), beta
(seconds per byte), GEMM rate, element-wise memory bandwidth and per-op overhead, and write
them as a cluster preset for gw.plan.

Every rank measures at the same time, so the numbers are the ones a job of this many ranks
sees: on a small machine ranks share cores, and a rate measured alone would be too fast.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch


def _rate(fn, window: float) -> float:
    """Calls of fn per second over a `window`-second run: every rank runs its window at the
    same time (after a barrier), so the rate is the one under this many ranks' contention."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < window:
        fn()
        calls += 1
    return calls / elapsed


def gemm_rate(n: int = 256, window: float = 1.0, device="cpu") -> float:
    """FLOP/s of an n x n float32 matmul on this process's threads."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n ** 3 * _rate(lambda: a @ b, window)


def vector_bandwidth(numel: int = 1 << 18, window: float = 1.0, device="cpu") -> float:
    """Bytes/s of an element-wise add (two reads, one write) on tensors of `numel` floats."""
    a, b, c = (torch.randn(numel, device=device), torch.randn(numel, device=device),
               torch.empty(numel, device=device))
    return 3 * 4 * numel * _rate(lambda: torch.add(a, b, out=c), window)


def launch_overhead(window: float = 1.0, device="cpu") -> float:
    """Seconds of one tiny autograd-recorded op: what each kernel costs beyond its work."""
    x = torch.ones(4, requires_grad=True, device=device)
    return 1 / _rate(lambda: x * 2.0, window)


def ring_all_gather(grid, sizes=(1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22), reps: int = 21) -> dict:
    """Seconds of the engine's ring all-gather over all ranks, per output size (bytes): the
    usual alpha-beta calibration, t = (g-1) alpha + (g-1)/g n beta (plan.collective_time)."""
    out = {}
    g = grid.world_size
    for nbytes in sizes:
        part = torch.zeros(max(1, nbytes // 4 // g), device=grid.device)
        grid.all_gather(part, "dp")
        ts = []
        for _ in range(reps):
            grid.barrier()
            t0 = time.perf_counter()
            grid.all_gather(part, "dp")
            ts.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(ts)
    return out


def fit_alpha_beta(times: dict) -> tuple:
    """Least squares t = alpha + beta * bytes."""
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - beta * mx, 1e-7)
    return alpha, max(beta, 1e-12)


def measure(grid) -> dict:
    """Every rank of `grid` measures at once; the medians over ranks, as a cluster preset."""
    g = grid.world_size
    times = ring_all_gather(grid) if g > 1 else {8: 1e-5, 1 << 20: 1e-3}
    # per ring step: alpha + (n / g) beta
    alpha, beta = fit_alpha_beta({n / max(g, 2): t / max(g - 1, 1) for n, t in times.items()})
    local = []
    for probe in (gemm_rate, vector_bandwidth, launch_overhead):
        grid.barrier()
        local.append(probe(device=grid.device))
    local = torch.tensor(local, dtype=torch.float64, device=grid.device)
    every = grid.all_gather(local.unsqueeze(0), "dp", dim=0) if grid.world_size > 1 else local.unsqueeze(0)
    gemm, vector, launch = (statistics.median(every[:, k].tolist()) for k in range(3))
    return {"name": "local", "about": f"measured by gridweave bench --calibrate with {grid.world_size} ranks at once",
            "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size)),
            "intra_alpha_s": alpha, "intra_bandwidth_Bps": 1 / beta,
            "inter_alpha_s": alpha, "inter_bandwidth_Bps": 1 / beta, "nics_per_node": 1,
            "gemm_flops": gemm, "vector_bandwidth_Bps": vector, "launch_s": launch,
            "memory_bytes": 24 * 2 ** 30, "ranks": grid.world_size,
            "measured_all_gather_s": {str(k): v for k, v in times.items()}}


def run(out: Path) -> dict:
    """Run inside 2+ ranks (torchrun): rank 0 writes the preset."""
    import gridweave as gw

    torch.set_num_threads(1)
    grid = gw.init(dp=int(os.environ.get("WORLD_SIZE", "1")))
    preset = measure(grid)
    if grid.rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(preset, indent=1))
    gw.shutdown()
    return preset
