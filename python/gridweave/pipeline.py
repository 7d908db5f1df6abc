"""Pipeline x data parallelism (seed 001, AxoNN; seed 003's 1F1B as the baseline).

A stage is an nn.Module holding this rank's contiguous run of layers. pipeline_step runs
one batch shard through the "pp" axis under the engine's schedule (cpp/pipeline.h):
"message_driven" (AxoNN Algorithm 2, pipeline_limit microbatches in flight) or "1f1b"
(Megatron's synchronous one-forward-one-backward with flush). The loss of every
microbatch is divided by the number of microbatches, so gradients are the shard's mean.
"""
from __future__ import annotations

import ctypes
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _C
from .errors import GridError


def optimal_ac(layers_per_stage: int, total_layers: int) -> int:
    """Seed 001 §V-A: the factor of the layers per stage closest to sqrt(total layers)."""
    if layers_per_stage < 1:
        raise GridError("a stage needs at least one layer")
    factors = [f for f in range(1, layers_per_stage + 1) if layers_per_stage % f == 0]
    return min(factors, key=lambda f: (abs(f - math.sqrt(total_layers)), f))


class PipelineStage(nn.Module):
    """This rank's layers. With ac > 1, only every ac-th layer's output is kept and the
    rest are recomputed in backward (torch.utils.checkpoint); ac="auto" uses optimal_ac."""

    def __init__(self, layers, total_layers=None, ac=1):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        n = len(self.layers)
        if ac == "auto":
            ac = optimal_ac(n, total_layers or n)
        if not isinstance(ac, int) or ac < 1 or n % ac:
            raise GridError(f"ac must be a factor of the {n} layers on this stage, got {ac!r}")
        self.ac = ac

    def forward(self, x):
        if self.ac == 1 or not torch.is_grad_enabled():
            for layer in self.layers:
                x = layer(x)
            return x
        for i in range(0, len(self.layers), self.ac):
            group = self.layers[i:i + self.ac]
            x = checkpoint(lambda t, g=group: _run(g, t), x, use_reentrant=False)
        return x


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


class _DeviceBytes:
    """Device memory the engine owns, seen through __cuda_array_interface__."""

    def __init__(self, addr, shape, dtype):
        typestr = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2"}.get(dtype)
        if typestr is None:
            raise GridError(f"pipeline activations of dtype {dtype} are not supported on CUDA")
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (addr, True),
                                         "version": 3, "strides": None}


def _tensor_at(addr: int, shape, dtype, device) -> torch.Tensor:
    """A copy of the message bytes the engine received at `addr` (on `device`)."""
    if device.type == "cuda":
        return torch.as_tensor(_DeviceBytes(addr, shape, dtype), device=device).clone()
    t = torch.empty(shape, dtype=dtype)
    ctypes.memmove(t.data_ptr(), addr, t.numel() * t.element_size())
    return t


def pipeline_step(stage: nn.Module, grid, inputs, targets, loss_fn, activation_shape, dtype=torch.float32,
                  schedule="message_driven", pipeline_limit=2, axis="pp"):
    """Forward and backward of every microbatch of this rank's batch shard.

    inputs: the microbatches (used on stage 0); targets: theirs (used on the last stage);
    loss_fn(output, target) -> scalar mean loss of one microbatch; activation_shape: the
    shape of what crosses a stage boundary. Returns (loss, stats): the mean microbatch loss
    on the last stage (None elsewhere) and the engine's PipelineStats.
    """
    pp = grid.comm(axis, "pipeline")
    s, n_stages = pp.rank, pp.size
    m = len(inputs) if s == 0 else len(targets) if s == n_stages - 1 else None
    counts = torch.tensor([float(m if m is not None else -1)], dtype=torch.float64)
    grid.all_reduce(counts, axis=axis, op="max")  # every stage learns the microbatch count
    m = int(counts.item())
    if m < 1:
        raise GridError("pipeline_step needs at least one microbatch")
    elem = torch.empty((), dtype=dtype).element_size()
    params = list(stage.parameters())
    device = params[0].device if params else torch.device("cpu")
    payload = math.prod(activation_shape) * elem
    ctx, keep, losses = {}, {}, []

    def forward(mb, addr):
        x = inputs[mb] if s == 0 else _tensor_at(addr, activation_shape, dtype, device).requires_grad_()
        y = stage(x)
        if s == n_stages - 1:
            loss = loss_fn(y, targets[mb]) / m
            losses.append(loss.detach())
            ctx[mb] = (x, loss)
            return 0
        if tuple(y.shape) != tuple(activation_shape) or y.dtype != dtype:
            raise GridError(f"stage {s} produced {tuple(y.shape)} {y.dtype}, the pipeline carries "
                            f"{tuple(activation_shape)} {dtype}")
        y = y.contiguous()
        ctx[mb] = (x, y)
        return y.data_ptr()

    def backward(mb, addr):
        x, y = ctx.pop(mb)
        if s == n_stages - 1:
            y.backward()
        else:
            y.backward(_tensor_at(addr, activation_shape, dtype, device))
        if s == 0:
            return 0
        g = x.grad.contiguous()
        keep[mb] = g  # alive until the engine has copied it into its message
        return g.data_ptr()

    stats = _C.run_pipeline(pp, schedule, s, n_stages, m, pipeline_limit, payload, forward, backward)
    loss = torch.stack(losses).sum() if losses else None
    return loss, stats
