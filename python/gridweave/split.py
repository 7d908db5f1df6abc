"""A backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2): B, the
gradient for a chunk's input, which the stage before waits for, and W, the gradients for its
weights, which nothing waits for and a schedule runs in its bubbles.

A chunk's linears are made deferrable (defer_weights). In a micro-batch whose backward is split
(its store's `current`, set around that micro-batch's forward and B), a linear's weights enter the
graph detached: its backward returns the input gradient alone and keeps (input, output gradient)
for W, and autograd never reaches the weights in B (even a None gradient would fire their hooks).
W sums them into the weights' gradients through autograd's own accumulation, so the hooks on it
(overlapped data-parallel reductions, OffloadAdam's) fire once, as after a whole backward.
Megatron's 1-D linears defer through the Deferrable protocol. Every other parameter (norms,
embeddings, the 2-D, 3-D and sub-graph layers, experts) gets its gradient in B: a layer whose
weights cannot wait is correct, only not deferred."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


class WeightStore:
    """One chunk's deferred weight gradients, by micro-batch. `current`: the micro-batch whose
    forward or B runs now with its backward split (set by the pipeline around them), or None: the
    linears run as torch's, their weight gradients in the backward."""

    def __init__(self):
        self.current = None
        self._held: dict = {}

    def keep(self, mb, fn) -> None:
        """fn() gives (parameter, gradient) pairs: W's share of one layer call."""
        self._held.setdefault(mb, []).append(fn)

    def run(self, mb) -> None:
        """W of micro-batch `mb`: every weight gradient its B left, summed per weight (a layer
        called twice in a micro-batch gives one) and added in one pass through the weights'
        AccumulateGrad nodes: .grad summed as autograd sums it, each hook fired once."""
        sums = {}
        with torch.no_grad():  # nothing in W is differentiated again
            for fn in self._held.pop(mb, ()):
                for p, g in fn():
                    if p is not None and g is not None and p.requires_grad:
                        sums[id(p)] = (p, g) if id(p) not in sums else (p, sums[id(p)][1] + g)
        if sums:
            torch.autograd.backward([torch.autograd.graph.get_gradient_edge(p) for p, _ in sums.values()],
                                    [g for _, g in sums.values()])

    def clear(self) -> None:
        """Forget every W not run (a failed step: what they hold goes with them)."""
        self._held.clear()
        self.current = None

    @property
    def pending(self) -> list:
        """The micro-batches whose W has not run."""
        return sorted(self._held)


def deferring(store, x) -> bool:
    """Whether a layer defers its weights' gradients for input `x` now: its store is in a split
    micro-batch and B reaches x (an input without a gradient takes them in the backward)."""
    return store is not None and store.current is not None and x.requires_grad


def defer(store: WeightStore, mb, params, grads) -> None:
    """W's share of a layer for micro-batch `mb`: grads() gives the gradients of `params` (None
    where one has none; a collective it needs is issued there, in the table's order, alike on every
    rank of the layer's group), added to them then."""
    store.keep(mb, lambda: zip(params, grads()))


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b with W and b detached (params: the leaves themselves, out of the graph): the
    backward gives dx, and W (store.run(mb)) later adds dW = dy^T x and db = sum dy to them."""

    @staticmethod
    def forward(ctx, x, weight, bias, params, store, mb):
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.store, ctx.mb = params, store, mb
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        has_bias = ctx.params[1] is not None

        def grads():
            g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
            return g2.t() @ x2, (g2.sum(0) if has_bias else None)
        defer(ctx.store, ctx.mb, ctx.params, grads)
        return (gy @ weight if ctx.needs_input_grad[0] else None), None, None, None, None, None


def linear(x, weight, bias, store):
    """F.linear(x, weight, bias), its weights' gradients deferred to W where `store` defers now."""
    if not deferring(store, x):
        return torch.nn.functional.linear(x, weight, bias)
    return _DeferredLinear.apply(x, weight.detach(), None if bias is None else bias.detach(), (weight, bias), store,
                                 store.current)


def _deferrable_forward(linear_module: nn.Linear, store: WeightStore, x):
    return linear(x, linear_module.weight, linear_module.bias, store)


def deferred_store(module: nn.Module):
    """The WeightStore a linear's weight gradients wait in (defer_weights), or None."""
    if isinstance(module, Deferrable):
        return module.weight_store
    forward = module.__dict__.get("forward")
    return forward.args[1] if isinstance(forward, functools.partial) and forward.func is _deferrable_forward \
        else None


class Deferrable:
    """A layer that defers its weights' gradients itself (the tensor-parallel linears): its forward
    passes `self.weight_store` to split.linear, or defers in its own backward (split.defer)."""

    weight_store: WeightStore | None = None


def defer_weights(chunk: nn.Module, store: WeightStore) -> int:
    """Every linear of `chunk` made to defer its weight gradients into `store` in the micro-batches
    it names: a Deferrable layer told its store; a linear whose forward is nn.Linear's own
    (nn.Linear and subclasses that keep it, as the replicated linears of the sequence-parallel
    layers) given a forward on the instance, class, parameters and state as they were (an optimizer
    made before still holds them). Returns how many there are."""
    n = 0
    for m in chunk.modules():
        if isinstance(m, Deferrable):
            m.weight_store = store
            n += 1
        elif isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            m.forward = functools.partial(_deferrable_forward, m, store)
            n += 1
    return n
