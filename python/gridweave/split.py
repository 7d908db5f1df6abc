"""A backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2): B, the
gradient for a chunk's input, which the stage before waits for, and W, the gradients for its
weights, which nothing waits for and a schedule runs in its bubbles.

A chunk's linears are made deferrable (defer_weights): while its store defers (B of one
micro-batch), each one's backward returns the input gradient alone and keeps (input, output
gradient) for W; W sums them into the weights' gradients through autograd's own accumulation, so
the hooks on it (overlapped data-parallel reductions, OffloadAdam's) fire as after a whole backward.
Every other parameter (norms, embeddings, tensor-parallel layers) gets its gradient in B: a layer
whose weights cannot wait is correct, only not deferred."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


class WeightStore:
    """One chunk's deferred weight gradients, by micro-batch. `deferring`: the micro-batch whose B
    runs now (set by the pipeline around it), or None: a whole backward computes them at once."""

    def __init__(self):
        self.deferring = None
        self._held: dict = {}

    def keep(self, fn) -> None:
        self._held.setdefault(self.deferring, []).append(fn)

    def run(self, mb) -> None:
        """W of micro-batch `mb`: every weight gradient its B left, into the weights' .grad."""
        for fn in self._held.pop(mb, ()):
            fn()

    @property
    def pending(self) -> list:
        """The micro-batches whose W has not run."""
        return sorted(self._held)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    # through the parameter's AccumulateGrad node: .grad summed as autograd sums it, hooks fired
    torch.autograd.backward(torch.autograd.graph.get_gradient_edge(param), grad)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.store = bias is not None, store
        ctx.params = (weight, bias)  # the leaves whose .grad W adds to
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        dx = gy @ weight if ctx.needs_input_grad[0] else None
        wants = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]

        def grads():
            g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
            return (g2.t() @ x2 if wants[0] else None), (g2.sum(0) if wants[1] else None)

        store = ctx.store
        if store is None or store.deferring is None:
            return (dx, *grads(), None)
        params = ctx.params

        def w():
            for p, g in zip(params, grads()):
                if g is not None:
                    _accumulate(p, g)
        store.keep(w)
        return dx, None, None, None


def _deferrable_forward(linear: nn.Linear, store: WeightStore, x):
    return _DeferrableLinear.apply(x, linear.weight, linear.bias, store)


def deferred_store(module: nn.Module):
    """The WeightStore a linear's weight gradients wait in (defer_weights), or None."""
    forward = module.__dict__.get("forward")
    return forward.args[1] if isinstance(forward, functools.partial) and forward.func is _deferrable_forward \
        else None


def defer_weights(chunk: nn.Module, store: WeightStore) -> int:
    """Every linear of `chunk` whose forward is nn.Linear's own (nn.Linear and subclasses that keep
    it, as the replicated linears of the sequence-parallel layers) made to defer its weight
    gradients into `store`: its forward replaced on the instance, class, parameters and state as
    they were (an optimizer made before still holds them). Returns how many there are."""
    n = 0
    for m in chunk.modules():
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            m.forward = functools.partial(_deferrable_forward, m, store)
            n += 1
    return n
