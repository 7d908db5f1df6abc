"""Vocab-parallel cross-entropy (Megatron-LM): logits stay split over the vocabulary; only
per-token scalars cross the network (a max, then the sum of exponentials and the target
logit in one buffer): 3 x b x s values instead of b x s x v."""
from __future__ import annotations

import torch


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, grid, axis):
        ctx.dtype = logits.dtype
        v_local = logits.shape[-1]
        start = grid.index(axis) * v_local
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        m = logits.max(dim=-1).values.contiguous()
        grid.all_reduce(m, axis=axis, op="max")
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - start
        inside = (local_t >= 0) & (local_t < v_local)
        local_t = torch.where(inside, local_t, torch.zeros_like(local_t))
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside
        sums = torch.stack([exp.sum(dim=-1), picked]).contiguous()
        grid.all_reduce(sums, axis=axis)
        loss = sums[0].log() - sums[1]
        ctx.save_for_backward(exp / sums[0].unsqueeze(-1), local_t, inside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
        return (grad * g.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, grid, axis="tp"):
    """Per-token loss from logits split over the vocabulary along `axis`."""
    return _VocabParallelCrossEntropy.apply(logits, target, grid, axis)
