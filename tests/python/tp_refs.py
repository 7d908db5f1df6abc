"""Helpers for the tensor-parallel tests: seeded full tensors and relative errors."""
import torch


def full(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(dtype)


def rel(a, b) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def tol(dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5
