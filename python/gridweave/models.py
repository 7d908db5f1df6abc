"""Models built from gridweave's layers: the GPT (GPT-2's architecture) and Llama (RMSNorm,
SwiGLU, rotary positions, grouped-query attention), dense or on a grid; Hugging Face interop
in gridweave.hf."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .autograd.comm import gather_from_parallel, scatter_to_parallel
from .errors import GridError
from .nn.dense import GPT2, LLAMA, Activation, Arch, DenseTransformerLayer, Norm
from .pipeline import run_layers


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's sizes and architecture: what a checkpoint and an export record.
    family: "gpt" (learned positions, LayerNorm, GeLU, biases) or "llama"."""
    family: str = "gpt"
    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    eps: float | None = None
    tie: bool = False
    activation: str | None = None  # gpt: "gelu" (exact) or "gelu_tanh" (GPT-2's gelu_new)

    def __post_init__(self):
        if self.family not in ("gpt", "llama"):
            raise GridError(f"model family must be 'gpt' or 'llama', got {self.family!r}")
        for name in ("vocab", "hidden", "heads", "layers", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"model {name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise GridError(f"hidden {self.hidden} does not split into {self.heads} heads")
        if (self.hidden // self.heads) % 2 and self.family == "llama":
            raise GridError(f"rotary positions need an even head size, got {self.hidden // self.heads}")
        self.arch.kv(self.heads)  # kv_heads divides heads

    @property
    def arch(self) -> Arch:
        if self.family == "llama":
            return Arch(Norm.RMS, Activation.SWIGLU, self.kv_heads, float(self.rope_theta),
                        LLAMA.eps if self.eps is None else self.eps)
        return Arch(Norm.LAYER, Activation(self.activation or "gelu"), self.kv_heads, None,
                    GPT2.eps if self.eps is None else self.eps)

    @property
    def bias(self) -> bool:
        return self.family == "gpt"

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family == "llama":  # Llama's 2/3 of 4h, rounded up to a multiple of 8
            return -(-8 * self.hidden // 3 // 8) * 8
        return 4 * self.hidden

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise GridError(f"unknown model config fields {sorted(unknown)}")
        return cls(**d)


class Embedding(nn.Module):
    """Token embeddings, plus learned position embeddings when the arch has no rotary ones:
    (batch, seq) ids -> (batch, seq, hidden)."""

    def __init__(self, vocab, hidden, seq, dtype=None, device=None, positions=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, dtype=dtype, device=device)
        self.pos = nn.Embedding(seq, hidden, dtype=dtype, device=device) if positions else None

    @classmethod
    def of(cls, tok: nn.Module, pos: nn.Module | None) -> "Embedding":
        """An Embedding of given token (e.g. vocab-parallel) and position modules."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.tok, m.pos = tok, pos
        return m

    def forward(self, ids):
        x = self.tok(ids)
        if self.pos is None:
            return x
        if ids.shape[1] > self.pos.num_embeddings:
            raise GridError(f"a sequence of {ids.shape[1]} tokens exceeds the model's {self.pos.num_embeddings} positions")
        return x + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """Final norm and the vocabulary projection."""

    def __init__(self, vocab, hidden, dtype=None, device=None, arch: Arch = GPT2):
        super().__init__()
        self.ln = arch.dense_norm(hidden, dtype=dtype, device=device)
        self.out = nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)

    @classmethod
    def of(cls, ln: nn.Module, out: nn.Module) -> "Head":
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.ln, m.out = ln, out
        return m

    def forward(self, x):
        return self.out(self.ln(x))


class GPT(nn.Module):
    """A decoder: embedding, `layers` pre-norm causal layers, head. GPT-2's architecture by
    default; gw.models.Llama (or config=ModelConfig(family="llama")) for Llama's."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, dtype=None, device=None,
                 config: ModelConfig | None = None):
        super().__init__()
        cfg = config or ModelConfig("gpt", vocab, hidden, heads, layers, seq)
        self.config = cfg
        self.vocab, self.seq = cfg.vocab, cfg.seq
        arch, kw = cfg.arch, dict(dtype=dtype, device=device)
        self.embed = Embedding(cfg.vocab, cfg.hidden, cfg.seq, positions=arch.rope_theta is None, **kw)
        self.layers = nn.ModuleList(DenseTransformerLayer(cfg.hidden, cfg.heads, cfg.ffn, bias=cfg.bias, arch=arch, **kw)
                                    for _ in range(cfg.layers))
        self.head = Head(cfg.vocab, cfg.hidden, arch=arch, **kw)
        if cfg.tie:
            self.head.out.weight = self.embed.tok.weight

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


class Llama(GPT):
    """A Llama-family decoder: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention
    (kv_heads < heads), no biases, optionally tied embeddings."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, kv_heads=None, ffn_hidden=None,
                 rope_theta=10000.0, eps=1e-6, tie=False, dtype=None, device=None):
        super().__init__(dtype=dtype, device=device,
                         config=ModelConfig("llama", vocab, hidden, heads, layers, seq, ffn_hidden, kv_heads,
                                            rope_theta, eps, tie))


def build(config: ModelConfig, dtype=None, device=None) -> GPT:
    """The dense model of a config."""
    return GPT(dtype=dtype, device=device, config=config)


def from_hf(model_or_config, dtype=None):
    """A gridweave model from a Hugging Face LlamaForCausalLM / GPT2LMHeadModel (same weights)
    or from its config (fresh weights); anything gridweave does not implement is a GridError
    naming the config field. Needs transformers (pip install gridweave[hf])."""
    from .hf import from_hf as impl

    return impl(model_or_config, dtype)


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
    """One pipeline stage of a GPT (or Llama) on a grid. The embedding (first stage) and the
    head (last stage) are computed on the whole data-parallel shard by every tensor and
    sequence rank, so their gradients are partial over "dp" only. Where the mode has a
    vocabulary axis (1-D: Megatron's vocab parallelism, seed 003 §3) the token embedding and
    the head's projection are split over the vocabulary there and the loss is the fused
    vocab-parallel cross-entropy (3 values per token cross the network, never the logits);
    the other modes replicate them (their papers do not split the vocabulary). The
    transformer layers are gw.nn.TransformerLayer in `mode` (a mode object, a layer-mode
    name, or None for the grid's own). Gradients follow the parameters' placements."""

    def __init__(self, gpt: GPT, grid, mode, stage: int, stages: int, ac=1, **layer_options):
        """ac: activation checkpointing (1: none, "auto": seed 001's optimal ac, or a factor
        of the stage's layers); layer_options go to each TransformerLayer (overlap, attention)."""
        super().__init__()
        from .modes import resolve
        from .pipeline import resolve_ac
        from .nn.transformer import TransformerLayer
        from .sharding import place, placement_of

        n = len(gpt.layers)
        if n % stages:
            raise GridError(f"{n} layers do not split over {stages} pipeline stages")
        k = n // stages
        if gpt.config.tie and stages > 1:
            raise GridError("tied embeddings need the embedding and the head on one pipeline stage (pp 1); "
                            "untie them (tie=False) to pipeline this model")
        self.mode = resolve(mode, grid)
        self.grid, self.stage, self.stages = grid, stage, stages
        self.first = range(stage * k, (stage + 1) * k)
        axis = self.mode.vocab_axis()
        self.vocab_axis = axis if axis is not None and grid.axes.get(axis, 1) > 1 else None
        self.embed = self._embed(gpt.embed) if stage == 0 else None
        self.head = self._head(gpt.head) if stage == stages - 1 else None
        if gpt.config.tie and self.vocab_axis is not None:
            self.head.out.weight = self.embed.tok.weight  # both split over the vocabulary alike
        for mod in (self.embed, self.head):
            for p in (mod.parameters() if mod is not None else ()):
                place(p, placement_of(p).layout, partial=("dp",))
        self.layers = nn.ModuleList(TransformerLayer.from_dense(gpt.layers[i], grid, mode=self.mode, **layer_options)
                                    for i in self.first)
        self.ac = resolve_ac(ac, k, n)
        self.layout = _without_dp(self.layers[0].input_layout)
        self.hidden = gpt.head.ln.normalized_shape[0]
        axis = self.mode.boundary_axis()
        self.boundary_axis = axis if axis is not None and grid.axes.get(axis, 1) > 1 and stages > 1 else None

    def _embed(self, dense: Embedding) -> Embedding:
        if self.vocab_axis is None:
            return dense.to(self.grid.device)
        from .nn.tensor1d import VocabParallelEmbedding

        tok = VocabParallelEmbedding.from_dense(dense.tok, self.grid, axis=self.vocab_axis, device=self.grid.device)
        return Embedding.of(tok, dense.pos.to(self.grid.device) if dense.pos is not None else None)

    def _head(self, dense: Head) -> Head:
        if self.vocab_axis is None:
            return dense.to(self.grid.device)
        from .nn.tensor1d import ColumnParallelLinear

        out = ColumnParallelLinear.from_dense(dense.out, self.grid, axis=self.vocab_axis, device=self.grid.device)
        return Head.of(dense.ln.to(self.grid.device), out)

    def full_logits(self, logits):
        """The last stage's output as whole logits on every rank (gathered over the vocabulary
        axis where the head is split; a copy otherwise). For inspection: the loss never needs it."""
        if self.vocab_axis is None:
            return logits
        from .layout import Layout, gather

        return gather(logits, Layout(*([()] * (logits.dim() - 1)), (self.vocab_axis,)), self.grid)

    def loss(self, logits, targets):
        """Mean cross-entropy over the tokens (the last stage's output; float32 or wider)."""
        if self.vocab_axis is None:
            return GPT.loss(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, targets)
        from .autograd.vocab import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), self.grid,
                                            self.vocab_axis).mean()

    def activation_shape(self, batch: int, seq: int) -> tuple:
        """What crosses a stage boundary on this rank (1/t of the hidden dim with scatter/gather)."""
        shape = self.layout.local_shape((batch, seq, self.hidden), self.grid)
        if self.boundary_axis is not None:
            shape = tuple(shape[:-1]) + (shape[-1] // self.grid.axes[self.boundary_axis],)
        if self.layout.only is not None and self.grid.coords[self.layout.only[0]] != self.layout.only[1]:
            shape = (0,) + tuple(shape[1:])
        return tuple(shape)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
            self._full = tuple(x.shape)
            x = _ToLayout.apply(x, self.layout, self.grid)
        elif self.boundary_axis is not None:  # 1/t from each tensor rank of the previous stage
            x = gather_from_parallel(x, self.grid, self.boundary_axis, -1)
        x = run_layers(self.layers, x, self.ac)
        if self.head is None and self.boundary_axis is not None:  # send only this rank's 1/t
            return scatter_to_parallel(x, self.grid, self.boundary_axis, -1)
        if self.head is not None:
            shape = self._full if self.embed is not None else self._full_shape(x)
            x = self.head(_FromLayout.apply(x, self.layout, self.grid, shape))
        return x

    def _full_shape(self, x):
        """Full dp-shard shape from a local shard (the last stage did not see the embedding)."""
        sizes = list(self.layout.global_shape(x.shape[:3], self.grid))
        if self.layout.only is not None:  # cSub: sub-grid 0 knows the batch; tell the others
            sizes = self.grid.broadcast_ints(sizes, self.layout.only[0], self.layout.only[1])
        return tuple(sizes)

    def dense_state(self, pick=False) -> dict:
        """This stage's tensors under the dense GPT's names (collective over the tp group)."""
        from .layout import gather
        from .nn.dense import values
        from .sharding import placement_of

        f = values(pick)
        out = {}
        for name, mod in (("embed", self.embed), ("head", self.head)):
            if mod is not None:
                out.update({f"{name}.{k}": gather(f(p).contiguous(), placement_of(p).layout, self.grid).clone()
                            for k, p in mod.named_parameters(remove_duplicate=False)})
        for i, layer in zip(self.first, self.layers):
            out.update({f"layers.{i}.{k}": v for k, v in layer.dense_state(pick).items()})
        return out

    def sharded_items(self) -> list:
        """(dense name, this rank's parameter, dense shape) of every parameter of this stage:
        what a sharded checkpoint saves and loads (gw.checkpoint), in placement terms."""
        from .sharding import placement_of

        def dense_shape(p):
            pl = placement_of(p)
            stored = pl.layout.global_shape(p.shape, self.grid)
            return tuple(reversed(stored)) if pl.transposed else stored

        out = []
        for name, mod in (("embed", self.embed), ("head", self.head)):
            if mod is not None:
                out += [(f"{name}.{k}", p, dense_shape(p)) for k, p in mod.named_parameters(remove_duplicate=False)]
        for i, layer in zip(self.first, self.layers):
            out += [(f"layers.{i}.{k}", p, dense_shape(p)) for k, p in layer.dense_named_parameters()]
        return out

    def load_dense_state(self, state: dict):
        """Load this stage's tensors from dense ones (a local slicing: no communication)."""
        from .layout import scatter
        from .nn.dense import DenseTransformerLayer
        from .sharding import placement_of

        with torch.no_grad():
            for name, mod in (("embed", self.embed), ("head", self.head)):
                if mod is not None:
                    for k, p in mod.named_parameters(remove_duplicate=False):
                        p.copy_(scatter(state[f"{name}.{k}"].to(p.device, p.dtype), placement_of(p).layout,
                                        self.grid))
            for i, layer in zip(self.first, self.layers):
                prefix = f"layers.{i}."
                w = next(layer.parameters())
                d = DenseTransformerLayer(layer.hidden, layer.heads, layer.ffn_hidden, bias=layer.bias,
                                          causal=layer.causal, dtype=w.dtype, device=w.device, arch=layer.arch)
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


class ModelChunks(nn.Module):
    """This rank's v model chunks for the interleaved schedule (seed 003 Fig. 4): chunk c is
    virtual stage c * stages + stage of v * stages (a GPTStage each), so every rank holds v
    thinner slices of the model and the pipeline bubble shrinks v-fold. gw.pipeline
    .pipeline_step runs them with schedule "interleaved"."""

    def __init__(self, gpt: GPT, grid, mode, stage: int, stages: int, chunks: int, **stage_options):
        super().__init__()
        if not isinstance(chunks, int) or chunks < 1:
            raise GridError(f"chunks must be a positive integer, got {chunks!r}")
        if len(gpt.layers) % (chunks * stages):
            raise GridError(f"{len(gpt.layers)} layers do not split into {chunks} chunks on each of {stages} "
                            "pipeline stages")
        self.chunks = nn.ModuleList(GPTStage(gpt, grid, mode, c * stages + stage, chunks * stages, **stage_options)
                                    for c in range(chunks))

    def loss(self, logits, targets):
        return self.chunks[-1].loss(logits, targets)

    def activation_shape(self, batch: int, seq: int) -> tuple:
        return self.chunks[0].activation_shape(batch, seq)

    def sharded_items(self) -> list:
        return [item for c in self.chunks for item in c.sharded_items()]

    def dense_state(self, pick=False) -> dict:
        return {k: v for c in self.chunks for k, v in c.dense_state(pick).items()}

    def load_dense_state(self, state: dict):
        for c in self.chunks:
            c.load_dense_state(state)

    def forward(self, x):
        raise GridError("model chunks run through gw.pipeline.pipeline_step(..., schedule='interleaved')")
