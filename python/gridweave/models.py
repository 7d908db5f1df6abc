"""Models built from gridweave's layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import GridError
from .nn.dense import DenseTransformerLayer


class Embedding(nn.Module):
    """Token + learned position embeddings: (batch, seq) ids -> (batch, seq, hidden)."""

    def __init__(self, vocab, hidden, seq, dtype=None, device=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
        self.pos = nn.Embedding(seq, hidden, dtype=dtype, device=device)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    def __init__(self, vocab, hidden, dtype=None, device=None):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.out = nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out(self.ln(x))


class GPT(nn.Module):
    """A GPT: embedding, `layers` pre-LN causal transformer layers, head."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, dtype=None, device=None):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.embed = Embedding(vocab, hidden, seq, dtype, device)
        self.layers = nn.ModuleList(DenseTransformerLayer(hidden, heads, dtype=dtype, device=device)
                                    for _ in range(layers))
        self.head = Head(vocab, hidden, dtype, device)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    @staticmethod
    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def stage_layers(self, stage: int, stages: int) -> list:
        """Stage `stage` of `stages`: the embedding on the first, the head on the last, the
        transformer layers split evenly."""
        n = len(self.layers)
        if n % stages:
            raise GridError(f"{n} layers do not split over {stages} pipeline stages")
        k = n // stages
        mods = list(self.layers[stage * k:(stage + 1) * k])
        if stage == 0:
            mods = [self.embed] + mods
        if stage == stages - 1:
            mods = mods + [self.head]
        return mods


# ---- the GPT on a grid: embedding and head replicated, transformer layers in a tp mode ----


def parse_tp(spec: str):
    """--tp none | row:N | square:Q | cube:P | subgraph:G | csub:G -> the mode object."""
    from .modes import parse

    return parse(spec)


def _without_dp(layout):
    from .layout import Layout

    dims = [tuple(a for a in d if a != "dp") for d in layout.dims]
    return Layout(*dims, zigzag=layout.zigzag, only=layout.only)


class _ToLayout(torch.autograd.Function):
    """Full (dp-shard) activation -> this rank's shard; backward gathers the gradient so every
    rank of the group holds the whole, identical gradient of the replicated embedding."""

    @staticmethod
    def forward(ctx, x, layout, grid):
        from .layout import scatter

        ctx.layout, ctx.grid, ctx.shape = layout, grid, tuple(x.shape)
        return scatter(x, layout, grid)

    @staticmethod
    def backward(ctx, g):
        from .layout import gather

        return gather(g.contiguous(), ctx.layout, ctx.grid, shape=ctx.shape), None, None


class _FromLayout(torch.autograd.Function):
    """This rank's shard -> the full (dp-shard) activation; backward keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x, layout, grid, shape):
        from .layout import gather

        ctx.layout, ctx.grid = layout, grid
        return gather(x, layout, grid, shape=shape)

    @staticmethod
    def backward(ctx, g):
        from .layout import scatter

        return scatter(g.contiguous(), ctx.layout, ctx.grid), None, None, None


class GPTStage(nn.Module):
    """One pipeline stage of a GPT on a grid: the embedding (first stage) and the head (last
    stage) are replicated (computed on the whole data-parallel shard by every tensor and
    sequence rank, so their gradients are partial over "dp" only); the transformer layers
    are gw.nn.TransformerLayer in `mode` (a mode object, a layer-mode name, or None for the
    grid's own). Gradients follow the parameters' placements (gw.reduce_gradients)."""

    def __init__(self, gpt: GPT, grid, mode, stage: int, stages: int):
        super().__init__()
        from .modes import resolve
        from .nn.transformer import TransformerLayer
        from .sharding import place

        n = len(gpt.layers)
        if n % stages:
            raise GridError(f"{n} layers do not split over {stages} pipeline stages")
        k = n // stages
        self.mode = resolve(mode, grid)
        self.grid, self.stage, self.stages = grid, stage, stages
        self.first = range(stage * k, (stage + 1) * k)
        self.embed = gpt.embed.to(grid.device) if stage == 0 else None
        self.head = gpt.head.to(grid.device) if stage == stages - 1 else None
        for mod in (self.embed, self.head):
            for p in (mod.parameters() if mod is not None else ()):
                place(p, partial=("dp",))
        self.layers = nn.ModuleList(TransformerLayer.from_dense(gpt.layers[i], grid, mode=self.mode)
                                    for i in self.first)
        self.layout = _without_dp(self.layers[0].input_layout)
        self.hidden = gpt.head.ln.normalized_shape[0]

    def activation_shape(self, batch: int, seq: int) -> tuple:
        shape = self.layout.local_shape((batch, seq, self.hidden), self.grid)
        if self.layout.only is not None and self.grid.coords[self.layout.only[0]] != self.layout.only[1]:
            shape = (0,) + tuple(shape[1:])
        return tuple(shape)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
            self._full = tuple(x.shape)
            x = _ToLayout.apply(x, self.layout, self.grid)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None:
            shape = self._full if self.embed is not None else self._full_shape(x)
            x = self.head(_FromLayout.apply(x, self.layout, self.grid, shape))
        return x

    def _full_shape(self, x):
        """Full dp-shard shape from a local shard (the last stage did not see the embedding)."""
        sizes = []
        for d in range(3):
            axes = self.layout.dims[d] if d < len(self.layout.dims) else ()
            k = 1
            for a in axes:
                k *= self.grid.axes[a]
            sizes.append(x.shape[d] * k)
        if self.layout.only is not None:  # cSub: sub-grid 0 knows the batch; tell the others
            t = torch.tensor(sizes, dtype=torch.int64, device=self.grid.device)
            self.grid.broadcast(t, axis=self.layout.only[0], src=self.layout.only[1])
            sizes = [int(v) for v in t.tolist()]
        return tuple(sizes)

    def dense_state(self, pick=False) -> dict:
        """This stage's tensors under the dense GPT's names (collective over the tp group)."""
        from .nn.dense import values

        f = values(pick)
        out = {}
        for name, mod in (("embed", self.embed), ("head", self.head)):
            if mod is not None:
                out.update({f"{name}.{k}": f(p).clone() for k, p in mod.named_parameters()})
        for i, layer in zip(self.first, self.layers):
            out.update({f"layers.{i}.{k}": v for k, v in layer.dense_state(pick).items()})
        return out

    def load_dense_state(self, state: dict):
        """Load this stage's tensors from dense ones (a local slicing: no communication)."""
        from .nn.dense import DenseTransformerLayer

        with torch.no_grad():
            for name, mod in (("embed", self.embed), ("head", self.head)):
                if mod is not None:
                    for k, p in mod.named_parameters():
                        p.copy_(state[f"{name}.{k}"])
            for i, layer in zip(self.first, self.layers):
                prefix = f"layers.{i}."
                w = next(layer.parameters())
                d = DenseTransformerLayer(layer.hidden, layer.heads, layer.ffn_hidden, bias=layer.bias,
                                          causal=layer.causal, dtype=w.dtype, device=w.device)
                d.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
                layer.load_dense(d)

    def local_from_dense(self, state: dict) -> dict:
        """The local shards of dense tensors shaped like this stage's parameters
        (e.g. optimizer states): {id(param): tensor}."""
        saved = [p.detach().clone() for p in self.parameters()]
        self.load_dense_state(state)
        out = {id(p): p.detach().clone() for p in self.parameters()}
        with torch.no_grad():
            for p, v in zip(self.parameters(), saved):
                p.copy_(v)
        return out
