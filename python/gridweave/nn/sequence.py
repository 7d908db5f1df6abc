"""Sequence parallelism helpers (seed 004): replicated linears, gradient reduction over
the sequence and data axes, and the token-mean loss that makes them exact.

Convention (the usual source of silent bugs): each rank's loss is the SUM of its local
token losses divided by the GLOBAL token count (global_token_mean); every replicated
parameter's gradient is then the SUM of the ranks' gradients over dp and sp
(reduce_gradients). Averaging local means, or averaging gradients over sp, is wrong
whenever ranks hold different token counts, and off by a factor N_sp otherwise.
"""
from __future__ import annotations

import torch
from torch import nn

from .dense import linear_tensors, values


class ReplicatedLinear(nn.Linear):
    """A torch Linear whose weights every rank holds (sequence and data parallel)."""

    def load_dense(self, dense: nn.Linear, order=None):
        w, b = linear_tensors(dense, order)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None:
                self.bias.copy_(b)

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": pick(self.weight).clone()}
        if self.bias is not None:
            out["bias"] = pick(self.bias).clone()
        return out


def _present(grid, axes):
    return tuple(a for a in axes if a in grid.axes and grid.axes[a] > 1)


def global_token_mean(local_sum: torch.Tensor, local_count: int, grid, axes=("dp", "sp")) -> torch.Tensor:
    """This rank's share of the mean over every token of the global batch."""
    axes = _present(grid, axes)
    total = torch.tensor([float(local_count)], dtype=torch.float64)
    if axes:
        grid.all_reduce(total, axis=axes)
    return local_sum / total.item()


def reduce_gradients(module: nn.Module, grid, axes=("dp", "sp")) -> None:
    """Sum the gradients of replicated parameters over `axes` (see global_token_mean)."""
    axes = _present(grid, axes)
    if not axes:
        return
    for p in module.parameters():
        if p.grad is not None:
            grid.all_reduce(p.grad, axis=axes)


def sequence_parallel(grid) -> bool:
    return grid.axes.get("sp", 1) > 1


def attend(qkv, heads, causal, grid, algorithm="ring"):
    """Attention of the local heads of a packed [q | k | v]: on this rank alone, or over the
    "sp" ring when the grid splits the sequence (blockwise, zigzag when causal; or RSA)."""
    from ..autograd.ring import ring_attention, ring_self_attention
    from .dense import attention

    if not sequence_parallel(grid):
        return attention(qkv, heads, causal)
    b, s, three_h = qkv.shape
    h = three_h // 3
    q, k, v = (t.reshape(b, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, dim=-1))
    if algorithm == "rsa":
        o = ring_self_attention(q, k, v, grid, "sp", causal)
    else:
        o = ring_attention(q, k, v, grid, "sp", causal, causal)
    return o.transpose(1, 2).reshape(b, s, h)
