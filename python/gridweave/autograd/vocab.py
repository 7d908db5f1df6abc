"""Vocab-parallel cross-entropy (Megatron-LM): logits stay split over the vocabulary; only
per-token scalars cross the network (a max, then the sum of exponentials and the target
logit in one buffer): 3 x b x s values instead of b x s x v."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


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


class _LinearCrossEntropy(torch.autograd.Function):
    """Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, §3.2): the projection and the
    loss chunk by chunk of tokens, each chunk's gradients made in the forward, so no token's
    logits outlive its chunk; held to the backward: the gradient of the features (hidden per
    token) and of the projection (its own size). Over a vocabulary split along `axis` each chunk's
    max, then its sum of exponentials and target logit, are all-reduced (Megatron's vocab-parallel
    cross-entropy), and the features' gradient is summed there once."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, grid, axis, ignore_index, grads):
        want_h, want_w, want_b = (grads and ctx.needs_input_grad[i] for i in range(3))
        rows, v_local = h.shape[0], weight.shape[0]
        start = grid.index(axis) * v_local if axis is not None else 0
        wide = torch.promote_types(h.dtype, torch.float32)  # the loss in fp32 or wider, as the unfused path
        chunk = max(1, -(-rows * h.shape[1] // v_local))  # a chunk's logits the size of the features (Liger's)
        total = torch.zeros((), dtype=wide, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=h.device) if want_w else None
        grad_b = torch.zeros(v_local, dtype=wide, device=h.device) if want_b and bias is not None else None
        for lo in range(0, rows, chunk):
            hc, t = h[lo:lo + chunk], target[lo:lo + chunk]
            logits = torch.nn.functional.linear(hc, weight, bias).to(wide)
            m = logits.max(dim=-1).values
            if axis is not None:
                grid.all_reduce(m, axis=axis, op="max")
            logits -= m.unsqueeze(-1)
            local = t - start
            inside = (local >= 0) & (local < v_local) & (t != ignore_index)
            local = torch.where(inside, local, torch.zeros_like(local))
            picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
            exp = logits.exp_()
            sums = torch.stack([exp.sum(dim=-1), picked])
            if axis is not None:
                grid.all_reduce(sums, axis=axis)
            valid = t != ignore_index
            total += ((sums[0].log() - sums[1]) * valid).sum()
            if grads:  # d loss / d logits: softmax less the target's one-hot, on the predicted tokens
                g = exp.div_(sums[0].unsqueeze(-1))
                g.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1).to(g.dtype))
                g.mul_(valid.unsqueeze(-1))
                g = g.to(h.dtype)
                if grad_h is not None:
                    grad_h[lo:lo + chunk] = g @ weight
                if grad_w is not None:
                    grad_w += (g.t() @ hc).to(wide)
                if grad_b is not None:
                    grad_b += g.sum(dim=0).to(wide)
        if grad_h is not None and axis is not None:  # every rank of the axis decides it alike
            grid.all_reduce(grad_h, axis=axis)  # the features are whole on every rank of the split vocabulary
        ctx.grads = (grad_h, grad_w, grad_b, weight.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        grad_h, grad_w, grad_b, dtype = ctx.grads  # made in the forward (grad mode on: else no backward)

        def scaled(t, to):  # the scale (a loss scale over the micro-batches) applied in fp32 or wider
            return None if t is None else (t.to(torch.promote_types(t.dtype, torch.float32)) * g).to(to)
        return (scaled(grad_h, grad_h.dtype if grad_h is not None else None), scaled(grad_w, dtype),
                scaled(grad_b, dtype), None, None, None, None, None)


def linear_cross_entropy(h, weight, bias, target, grid=None, axis=None, ignore_index=-100):
    """The sum over the predicted tokens (target != ignore_index) of the cross-entropy of
    F.linear(h, weight, bias) against `target`, fused (_LinearCrossEntropy). h: (tokens, hidden);
    weight: (vocabulary, hidden), or this rank's rows of a vocabulary split along `axis` of
    `grid` (its start index * rows, Megatron's vocab parallelism). The gradients are made in the
    forward where grad mode is on (and then a backward is expected)."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    return _LinearCrossEntropy.apply(h, weight, bias, target, grid, axis, ignore_index, grads)
