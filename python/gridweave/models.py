"""Models built from gridweave's layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import GridError
from .nn.dense import DenseTransformerLayer


class Embedding(nn.Module):
    """Token + learned position embeddings: (batch, seq) ids -> (batch, seq, hidden)."""

    def __init__(self, vocab, hidden, seq, dtype=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, dtype=dtype)
        self.pos = nn.Embedding(seq, hidden, dtype=dtype)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    def __init__(self, vocab, hidden, dtype=None):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, dtype=dtype)
        self.out = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, x):
        return self.out(self.ln(x))


class GPT(nn.Module):
    """A GPT: embedding, `layers` pre-LN causal transformer layers, head."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, dtype=None):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.embed = Embedding(vocab, hidden, seq, dtype)
        self.layers = nn.ModuleList(DenseTransformerLayer(hidden, heads, dtype=dtype) for _ in range(layers))
        self.head = Head(vocab, hidden, dtype)

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

TP_MODES = {"none": "sp", "row": "1d", "square": "2d", "cube": "3d", "subgraph": "dsp", "csub": "csub"}


def parse_tp(spec: str):
    """--tp none | row:N | square:Q | cube:P | subgraph:G | csub:G -> (layer mode, gw.init tp)."""
    from . import topology

    spec = (spec or "none").lower()
    if spec == "none":
        return "sp", None
    kind, _, n = spec.partition(":")
    if kind not in TP_MODES or not n.isdigit() or int(n) < 1:
        raise GridError(f"--tp must be none, row:N, square:Q, cube:P, subgraph:G or csub:G; got {spec!r}")
    n = int(n)
    tp = {"row": topology.Row, "square": topology.Square, "cube": topology.Cube, "subgraph": topology.SubGraph,
          "csub": topology.SubGraph}[kind](n)
    return TP_MODES[kind], tp


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
    stage) are replicated; the transformer layers are gw.nn.TransformerLayer in `mode`.
    Gradients: reduce_gradients() sums the layers' gradients over "sp" (and the common
    ones over "sg"); the data-parallel average is the optimizer's (OffloadAdam)."""

    def __init__(self, gpt: GPT, grid, mode: str, stage: int, stages: int):
        super().__init__()
        from .nn.transformer import TransformerLayer

        n = len(gpt.layers)
        if n % stages:
            raise GridError(f"{n} layers do not split over {stages} pipeline stages")
        k = n // stages
        self.grid, self.mode, self.stage, self.stages = grid, mode, stage, stages
        self.first = range(stage * k, (stage + 1) * k)
        self.embed = gpt.embed if stage == 0 else None
        self.head = gpt.head if stage == stages - 1 else None
        self.layers = nn.ModuleList(TransformerLayer.from_dense(gpt.layers[i], grid, mode=mode) for i in self.first)
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
            t = torch.tensor(sizes, dtype=torch.int64)
            self.grid.broadcast(t, axis=self.layout.only[0], src=self.layout.only[1])
            sizes = [int(v) for v in t]
        return tuple(sizes)

    def reduce_gradients(self):
        from .nn.subgraph import reduce_gradients_of

        layer_params = [p for layer in self.layers for p in layer.parameters()]
        if self.grid.axes.get("sp", 1) > 1:
            reduce_gradients_of(layer_params, self.grid, ("sp",))
        if self.mode in ("dsp", "csub") and self.grid.axes.get("sg", 1) > 1:
            branch = {id(p) for layer in self.layers for p in layer.attn.branch_parameters()}
            reduce_gradients_of([p for p in layer_params if id(p) not in branch], self.grid, ("sg",))

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
                d = DenseTransformerLayer(layer.hidden, layer.heads, layer.ffn_hidden, bias=layer.bias,
                                          causal=layer.causal, dtype=next(layer.parameters()).dtype)
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
