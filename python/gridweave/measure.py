"""Rates of this process's device under the ranks running beside it: what the planner's
calibration (gridweave.calibrate) and the main job's MFU read."""
from __future__ import annotations

import time

import torch


def call_rate(fn, window: float, device="cpu") -> float:
    """Calls of fn per second over a `window`-second run: every rank runs its window at the
    same time (after a barrier), so the rate is the one under this many ranks' contention.
    On CUDA the kernels queued in the window are waited for: the rate is the device's."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    sync()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window:
        fn()
        calls += 1
    sync()
    return calls / (time.perf_counter() - t0)


def gemm_rate(n: int = 256, window: float = 1.0, device="cpu") -> float:
    """FLOP/s of an n x n float32 matmul on this process's threads."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n ** 3 * call_rate(lambda: a @ b, window, device)


def vector_bandwidth(numel: int = 1 << 18, window: float = 1.0, device="cpu") -> float:
    """Bytes/s of an element-wise add (two reads, one write) on tensors of `numel` floats."""
    a, b, c = (torch.randn(numel, device=device), torch.randn(numel, device=device),
               torch.empty(numel, device=device))
    return 3 * 4 * numel * call_rate(lambda: torch.add(a, b, out=c), window, device)
