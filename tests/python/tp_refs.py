"""Helpers for the tensor-parallel tests: seeded full tensors and relative errors, on the
device the tests compute on: DEVICE, cpu unless GRIDWEAVE_TEST_DEVICE says cuda (the GPU
tier, scripts/test_gpu.sh, runs the layer, ring, pipeline and sharding tests so)."""
import os

import torch

DEVICE = torch.device(os.environ.get("GRIDWEAVE_TEST_DEVICE", "cpu"))


def full(shape, seed, dtype=torch.float64, device=None):
    g = torch.Generator(device="cpu").manual_seed(seed)  # the same values on every device
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(device or DEVICE, dtype)


def rel(a, b) -> float:
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def tol(dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-5
