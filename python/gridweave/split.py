"""A backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2): B, the
gradient for a chunk's input, which the stage before waits for, and W, the gradients for its
weights, which nothing waits for and a schedule runs in its bubbles.

A chunk's linears are made deferrable (defer_weights). In a micro-batch whose backward is split
(its store's `current`, set around that micro-batch's forward and B), a linear's weights enter the
graph detached: its backward returns the input gradient alone and keeps (input, output gradient)
for W, and autograd never reaches the weights in B (even a None gradient would fire their hooks).
W sums them into the weights' gradients through autograd's own accumulation, so the hooks on it
(overlapped data-parallel reductions, OffloadAdam's) fire once, as after a whole backward.
Megatron's 1-D linears defer through the Deferrable protocol, as do the 2-D (SUMMA) and 3-D
(Bian et al.) linears and norms, whose weight products and reductions run in W, in the table's
order on every rank. Layers of plain torch ops on their weights (torch's norms, the experts'
grouped products, Qwen3's head norms, Linformer's projections, the vectors of the 2-D and 3-D
layers) defer through `apart`, torch's own split of a graph at its weights. What keeps its
gradient in B: the embeddings (their input has no gradient: nothing waits for it) and the fused
linear cross-entropy's head (its gradients are made in the forward, chunk by chunk)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from . import float8
from .errors import GridError


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


def deferral(store, x, params) -> tuple:
    """For a layer's op on input x with weights `params`: ((store, micro-batch, params) where its
    weights' gradients wait for W now, else None; the params as the op takes them, detached where
    they wait, so autograd never reaches them in B)."""
    params = tuple(params)
    if not deferring(store, x):
        return None, params
    return (store, store.current, params), tuple(None if p is None else p.detach() for p in params)


def defer(store: WeightStore, mb, params, grads) -> None:
    """W's share of a layer for micro-batch `mb`: grads() gives the gradients of `params` (None
    where one has none; a collective it needs is issued there, in the table's order, alike on every
    rank of the layer's group), added to them then."""
    store.keep(mb, lambda: zip(params, grads()))


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b with W and b detached (deferral's: the leaves themselves out of the graph): the
    backward gives dx, and W (store.run(mb)) later adds dW = dy^T x and db = sum dy to them."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred, recipe=None):
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.has_bias, ctx.recipe = deferred, bias is not None, recipe
        return float8.output(x, weight, recipe, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        has_bias, recipe = ctx.has_bias, ctx.recipe

        def grads():
            return float8.grad_weight(gy, x, recipe), (gy.reshape(-1, gy.shape[-1]).sum(0) if has_bias else None)
        defer(*ctx.deferred, grads)
        return (float8.grad_input(gy, weight, recipe) if ctx.needs_input_grad[0] else None), None, None, None, None


def _hooked() -> bool:
    """Whether saved tensors pass through hooks now (activation checkpointing's, which drop them to
    recompute them; where torch cannot say, as if they did)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _graph(fn, x, params) -> tuple:
    """(x's leaf, the params' leaves, fn's output) on a graph of their own."""
    with torch.enable_grad():
        xl = x.detach().requires_grad_()
        leaves = [None if p is None else p.detach().requires_grad_() for p in params]
        out = fn(xl, *leaves)
        if out._is_view():  # torch's B detaches the output in place (its graph's memory goes)
            out = out.clone()
    return xl, leaves, out


class _Apart(torch.autograd.Function):
    """fn(x, *params) of plain torch ops (and autograd Functions reached from x alone) on a graph of
    its own: B runs the nodes x's gradient needs, W the rest from the intermediates' gradients B
    kept (torch.distributed.pipelining's stage_backward_input / stage_backward_weight, what its
    zero-bubble schedules run on a whole stage), so no product runs twice and a collective on the
    weights' side (a vector's reduce-scatter) runs in W. Under activation checkpointing the graph
    is made again in B from the saved input (its tensors must go with the checkpoint's: kept from
    the forward they would outlive it, and each of B's and W's graph tasks would recompute the
    whole checkpointed block)."""

    @staticmethod
    def forward(ctx, x, fn, deferred, *detached):
        ctx.fn, ctx.deferred = fn, deferred
        if _hooked():
            ctx.graph = None
            ctx.save_for_backward(x, *detached)
            return fn(x, *detached)
        ctx.graph = _graph(fn, x, detached)
        return ctx.graph[2].detach()

    @staticmethod
    def backward(ctx, g):
        if ctx.graph is None:
            x, *detached = ctx.saved_tensors
            ctx.graph = _graph(ctx.fn, x, detached)
        xl, leaves, out = ctx.graph
        del ctx.graph
        store, mb, params = ctx.deferred
        # imported here: it loads torch.distributed.pipelining, dynamo and DTensor (1.5 s a process)
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        live = [p for p in leaves if p is not None]
        with torch.enable_grad():  # torch's helpers find the leaves' accumulators through a view
            (dx,), groups = stage_backward_input([out], [g], [xl], iter(live))
        xl.grad = None
        grouped = [p for group in groups for p in group["params"]]
        if len(grouped) != len(set(grouped)):  # W would add such a weight's gradient twice
            raise GridError("gw.split.apart: a weight meets the input's path where another does; split the layer "
                            "so that each weight meets it at ops of its own")

        def grads():
            with torch.enable_grad():
                stage_backward_weight(iter(live), groups)
            return [None if p is None else p.grad for p in leaves]
        defer(store, mb, params, grads)
        return (dx, None, None) + (None,) * len(leaves)


def apart(store, fn, x, *params):
    """fn(x, *params), its params' gradients deferred to W where `store` defers now (B: x's alone).
    fn: torch ops on x and the params, each param meeting x's path at ops of its own (torch groups
    the weights by where they meet it); autograd Functions in it must take the params alone or x
    alone (a Function's backward makes every gradient it was asked for at once)."""
    deferred, detached = deferral(store, x, params)
    if deferred is None:
        return fn(x, *params)
    return _Apart.apply(x, fn, deferred, *detached)


def linear(x, weight, bias, store, recipe=None):
    """F.linear(x, weight, bias), its weights' gradients deferred to W where `store` defers now;
    recipe: a gw.float8.Float8Recipe its three products run with (None: x's dtype)."""
    deferred, (w, b) = deferral(store, x, (weight, bias))
    if deferred is None:
        return float8.linear(x, weight, bias, recipe)
    return _DeferredLinear.apply(x, w, b, deferred, recipe)


def _deferrable_forward(linear_module: nn.Linear, store: WeightStore, x):
    return linear(x, linear_module.weight, linear_module.bias, store)


def _norm(module, x, weight, bias):
    if isinstance(module, nn.RMSNorm):
        return torch.nn.functional.rms_norm(x, module.normalized_shape, weight, module.eps)
    return torch.nn.functional.layer_norm(x, module.normalized_shape, weight, bias, module.eps)


def _deferrable_norm(norm: nn.Module, store: WeightStore, x):
    return apart(store, functools.partial(_norm, norm), x, norm.weight, getattr(norm, "bias", None))


_TORCH_FORWARDS = {nn.Linear: _deferrable_forward, nn.LayerNorm: _deferrable_norm, nn.RMSNorm: _deferrable_norm}


def deferred_store(module: nn.Module):
    """The WeightStore a linear's weight gradients wait in (defer_weights), or None."""
    if isinstance(module, Deferrable):
        return module.weight_store
    forward = module.__dict__.get("forward")
    return forward.args[1] if isinstance(forward, functools.partial) and forward.func in _TORCH_FORWARDS.values() \
        else None


class Deferrable:
    """A layer that defers its weights' gradients itself (the tensor-parallel linears): its forward
    passes `self.weight_store` to split.linear, or defers in its own backward (split.defer)."""

    weight_store: WeightStore | None = None


def chunk_store(chunk: nn.Module) -> WeightStore:
    """The WeightStore `chunk`'s layers defer into, made (defer_weights) the first time a split
    schedule runs the chunk and kept for its later steps (empty between steps)."""
    store = chunk.__dict__.get("_weight_store")
    if store is None:
        store = chunk.__dict__["_weight_store"] = WeightStore()
        defer_weights(chunk, store)
    return store


def defer_weights(chunk: nn.Module, store: WeightStore) -> int:
    """Every layer of `chunk` with weights made to defer their gradients into `store` in the
    micro-batches it names: a Deferrable layer told its store; a torch Linear, LayerNorm or RMSNorm
    whose forward is torch's own (subclasses that keep it too, as the replicated linears and norms
    of the sequence-parallel layers) given a forward on the instance, class, parameters and state
    as they were (an optimizer made before still holds them). Returns how many there are."""
    n = 0
    for m in chunk.modules():
        if isinstance(m, Deferrable):
            m.weight_store = store
            n += 1
            continue
        for base, forward in _TORCH_FORWARDS.items():
            if isinstance(m, base) and type(m).forward is base.forward and next(m.parameters(False), None) is not None:
                m.forward = functools.partial(forward, m, store)
                n += 1
    return n
