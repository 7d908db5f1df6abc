"""Deterministic per-rank inputs and numpy references shared by the tests."""
import numpy as np
import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def rank_input(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    """Small integers: exact in every dtype, and so are their sums over <= 8 ranks."""
    rng = np.random.default_rng(1000 * salt + rank)
    return torch.from_numpy(rng.integers(-8, 9, size=shape).astype(np.float64)).to(dtype)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def reduce_np(arrays, op: str) -> np.ndarray:
    return {"sum": np.sum, "max": np.max, "min": np.min}[op](np.stack(arrays), axis=0)


def grid_errors(makers):
    """Run each maker; the GridError message it raised, or None if it raised nothing."""
    import gridweave as gw

    out = []
    for make in makers:
        try:
            make()
            out.append(None)
        except gw.GridError as e:
            out.append(str(e))
    return out
