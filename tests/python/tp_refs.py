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


def packed_documents(batch, length, seed):
    """(batch, length) document ids of packed sequences: documents of 1 to length/2 - 1 tokens
    that cross every shard boundary (issue 31's tests)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.int64, device="cpu")
    for b in range(batch):
        i, d = 0, 0
        while i < length:
            n = int(torch.randint(1, length // 2, (1,), generator=g, device="cpu"))
            out[b, i:i + n] = d
            i, d = i + n, d + 1
    return out.to(DEVICE)


def layer_errors(layer, dense, grid, x, xl, y, yl) -> dict:
    """A parallel layer's output, input gradient, every parameter gradient and to_dense against
    the dense layer's (relative errors); the gradients already reduced over their partial axes."""
    import gridweave as gw

    errs = {"y": rel(gw.gather(yl.detach(), layer.output_layout, grid, shape=y.shape), y),
            "dx": rel(gw.gather(xl.grad, layer.input_layout, grid, shape=x.shape), x.grad)}
    grads = layer.dense_state(grad=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    state = layer.to_dense().state_dict()
    errs["to_dense"] = max(rel(state[k], v) for k, v in dense.state_dict().items())
    return errs
