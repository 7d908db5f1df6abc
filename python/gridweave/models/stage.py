"""The dense model on a grid: one pipeline stage's embedding, head and transformer layers in
a tensor-parallel mode (the layers from gw.nn, made by the mode object), and the chunks of
the interleaved schedule."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..autograd.comm import gather_from_parallel, scatter_to_parallel
from ..autograd.vocab import linear_cross_entropy, vocab_parallel_cross_entropy
from ..documents import Packed, balanced_order, ids_of, order_of
from ..errors import GridError
from ..layout import Layout, gather, scatter
from ..modes import parse, resolve
from ..nn.dense import DenseTransformerLayer, values
from ..nn.moe import balancing_biases
from ..nn.sequence import SeqAttention, shard_positions
from ..nn.tensor1d import ColumnParallelLinear, VocabParallelEmbedding
from ..nn.transformer import TransformerLayer
from ..pipeline import resolve_ac, run_layers
from ..schedules import Placement
from ..sharding import place, placement_of
from .dense import GPT, IGNORE, Embedding, Head

# ---- the GPT on a grid: embedding and head replicated, transformer layers in a tp mode ----


def parse_tp(spec: str):
    """A mode written as text (none | row:N | square:Q | cube:P | subgraph:G | csub:G) -> the
    mode object (gw.modes.parse)."""
    return parse(spec)


class _ToLayout(torch.autograd.Function):
    """Full (dp-shard) activation -> this rank's shard; backward gathers the gradient so every
    rank of the group holds the whole, identical gradient of the replicated embedding."""

    @staticmethod
    def forward(ctx, x, layout, grid):
        ctx.layout, ctx.grid, ctx.shape = layout, grid, tuple(x.shape)
        return scatter(x, layout, grid)

    @staticmethod
    def backward(ctx, g):
        return gather(g.contiguous(), ctx.layout, ctx.grid, shape=ctx.shape), None, None


class _FromLayout(torch.autograd.Function):
    """This rank's shard -> the full (dp-shard) activation; backward keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x, layout, grid, shape):
        ctx.layout, ctx.grid = layout, grid
        return gather(x, layout, grid, shape=shape)

    @staticmethod
    def backward(ctx, g):
        return scatter(g.contiguous(), ctx.layout, ctx.grid), None, None, None


def sequence_split(layout: Layout) -> tuple:
    """A layer layout of (batch, seq, hidden) split in two: the sequence's "sp" part, as a layout
    of (batch, seq) token ids and targets (the shard each rank embeds and scores: Li et al. §3,
    no rank holds the whole sequence), and the rest, from that shard to the layer layout (tp-sp's
    pieces over tp, 2-D/3-D's). (None, layout) where the grid does not split the sequence over sp."""
    seq_axes = layout.dims[1] if len(layout.dims) > 1 else ()
    if "sp" not in seq_axes:
        return None, layout
    if seq_axes[0] != "sp":
        raise GridError(f"layout {layout}: the sequence must be split over 'sp' first")
    zig = 1 if layout.zigzag == 1 else None
    dims = [d if i != 1 else tuple(a for a in d if a != "sp") for i, d in enumerate(layout.dims)]
    return Layout((), ("sp",), zigzag=zig, ring=layout.ring), Layout(*dims, only=layout.only)


class GPTStage(nn.Module):
    """One pipeline stage of a GPT (or Llama) on a grid. The embedding (first stage) and the
    head (last stage) run on this rank's sequence shard (Li et al. §3: each rank embeds its own
    L/N tokens, at their global positions, and scores them) and on the whole sequence where the
    grid has no "sp" axis; their gradients are partial over "dp" and "sp". Where the mode has a
    vocabulary axis (1-D: Megatron's vocab parallelism, Megatron-LM §3) the token embedding and
    the head's projection are split over the vocabulary there and the loss is the fused
    vocab-parallel cross-entropy (3 values per token cross the network, never the logits);
    each sequence rank's loss is its shard's sum over the replica's predicted tokens;
    the other modes replicate them (their papers do not split the vocabulary). The
    transformer layers are gw.nn.TransformerLayer in `mode` (a mode object, a layer-mode
    name, or None for the grid's own). Gradients follow the parameters' placements."""

    def __init__(self, gpt: GPT, grid, mode, stage: int, stages: int, ac=1, fused_loss: bool = False,
                 **layer_options):
        """ac: activation checkpointing (1: none, "auto": AxoNN's optimal ac, or a factor
        of the stage's layers); fused_loss: the last stage returns the head's input and loss() runs
        the head, projecting and scoring its features chunk by chunk of tokens (Liger-Kernel's
        fused linear cross-entropy: no token's logits are kept for the backward); layer_options go
        to each TransformerLayer (overlap, attention)."""
        super().__init__()
        if not isinstance(fused_loss, bool):
            raise GridError(f"fused_loss must be True or False, got {fused_loss!r}")
        self.fused_loss = fused_loss

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
        # the ends first in parameters() (embedding, head, then the layers: the optimizer's and the
        # planner's order), though made once the layers' layout is known
        self.register_module("embed", None)
        self.register_module("head", None)
        self.layers = nn.ModuleList(TransformerLayer.from_dense(gpt.layers[i], grid, mode=self.mode, **layer_options)
                                    for i in self.first)
        self.ac = resolve_ac(ac, k, n)
        self.layout = self.layers[0].input_layout.without("dp")
        self.seq, self.inner = sequence_split(self.layout)
        # the loss (and the ends' gradients) of a sequence rank: its shard's part, summed over sp
        self.loss_partial = ("sp",) if self.seq is not None else ()
        self.embed = self._embed(gpt.embed) if stage == 0 else None
        self.head = self._head(gpt.head) if stage == stages - 1 else None
        if gpt.config.tie and self.vocab_axis is not None:
            self.head.out.weight = self.embed.tok.weight  # both split over the vocabulary alike
        for mod in (self.embed, self.head):
            for p in (mod.parameters() if mod is not None else ()):
                place(p, placement_of(p).layout, partial=("dp",) + self.loss_partial)
        self.hidden = gpt.head.ln.normalized_shape[0]
        self._step_full = None  # the step's micro-batch (batch, seq, hidden): activation_shape sets it
        self._order = None  # the chunk order of the micro-batch forward() last ran (packed documents)
        axis = self.mode.boundary_axis()
        self.boundary_axis = axis if axis is not None and grid.axes.get(axis, 1) > 1 and stages > 1 else None

    def _embed(self, dense: Embedding) -> Embedding:
        if self.vocab_axis is None:
            return dense.to(self.grid.device)

        tok = VocabParallelEmbedding.from_dense(dense.tok, self.grid, axis=self.vocab_axis, device=self.grid.device)
        return Embedding.of(tok, *(m.to(self.grid.device) if m is not None else None for m in (dense.pos, dense.ln)))

    def _head(self, dense: Head) -> Head:
        if self.vocab_axis is None:
            return dense.to(self.grid.device)

        out = ColumnParallelLinear.from_dense(dense.out, self.grid, axis=self.vocab_axis, device=self.grid.device)
        transform = dense.transform.to(self.grid.device) if dense.transform is not None else None
        return Head.of(dense.ln.to(self.grid.device), out, transform, dense.act)

    def full_logits(self, logits):
        """The last stage's output as whole logits on every rank (gathered over the sequence and
        the vocabulary axis where they are split; a copy otherwise; with fused_loss the output is
        the head's input, run through it here). For inspection: the loss never needs it."""
        if self.fused_loss:
            logits = self.head(logits)
        if self.vocab_axis is not None:
            logits = gather(logits, Layout(*([()] * (logits.dim() - 1)), (self.vocab_axis,)), self.grid)
        if self.seq is None:
            return logits
        if self._order is None:
            return gather(logits, self.seq, self.grid)
        dealt = gather(logits, Layout((), ("sp",)), self.grid)  # in the chunk order's sequence
        return dealt.index_select(1, torch.argsort(self._order.permutation(logits.device)))

    def shard_tokens(self, t, order=None):
        """This rank's sequence shard of a (batch, seq) tensor of the whole sequence (token ids,
        targets): what it embeds and scores (a local slice: no communication). order: packed
        documents' ChunkOrder (pack), or None: the layers' zigzag or contiguous shards."""
        if self.seq is None:
            return t
        if order is None:
            return scatter(t, self.seq, self.grid)
        local = t.shape[1] // self.grid.axes["sp"]
        return t.index_select(1, shard_positions(order, local, self.grid.index("sp"), t.device))

    def pack(self, documents):
        """A micro-batch's packed document ids (on the host, from the loader) as the layers take
        them: where the ring (or USP's ring) splits the sequence, with the chunks each ring member
        holds dealt by attention work (gw.documents.balanced_order; computed from the host's ids,
        so nothing waits on the device); otherwise the ids. On the grid's device."""
        attn = self.layers[0].attn
        algorithm = getattr(attn, "attention", None)
        ids = documents.to(self.grid.device)
        if self.seq is None or algorithm not in (SeqAttention.RING, SeqAttention.USP):
            return ids
        members = algorithm.ring(self.grid.axes["sp"], attn.ulysses_degree) or self.grid.axes["sp"]
        return Packed(ids, balanced_order(documents, members, attn.causal))

    def loss(self, logits, targets, normalizer=None):
        """Cross-entropy of the predicted tokens (targets: the whole sequence's, IGNORE not
        predicted; logits: the last stage's output, float32 or wider): their mean, or their sum
        over `normalizer` (the masked LM's share of the global batch's predicted tokens,
        train.train_step). With sp each rank sums its shard's tokens over the replica's predicted
        count (known from the targets every rank holds: no communication); the sum over sp is
        the loss (loss_partial)."""
        if self.seq is not None and normalizer is None:
            normalizer = (targets != IGNORE).sum().clamp(min=1)
        targets = self.shard_tokens(targets, self._order).reshape(-1)
        predicted = targets != IGNORE
        if self.fused_loss:  # `logits` are the head's input: its features projected and scored in its call
            total = self.head(logits, score=lambda f, out: linear_cross_entropy(
                f.reshape(-1, f.shape[-1]), out.weight, out.bias, targets, self.grid, self.vocab_axis, IGNORE))
        elif self.vocab_axis is None:
            logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
            if normalizer is None:
                return GPT.loss(logits, targets)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=IGNORE,
                                    reduction="none").sum()
        else:
            total = (vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, self.grid,
                                                  self.vocab_axis) * predicted).sum()
        return total / (predicted.sum().clamp(min=1) if normalizer is None else normalizer)

    def activation_shape(self, batch: int, seq: int) -> tuple:
        """What crosses a stage boundary on this rank (1/t of the hidden dim with scatter/gather).
        The pipeline asks it before every step: the stage and its layers then know the step's
        micro-batch shape, so ranks that hold none of it (cSub) need not be told it each layer."""
        shape = self.layout.local_shape((batch, seq, self.hidden), self.grid)
        self._step_full = self.inner.global_shape(shape, self.grid)  # this rank's sequence shard's
        for m in self.modules():
            if hasattr(m, "common_shape_hint"):
                m.common_shape_hint = tuple(shape)
        if self.boundary_axis is not None:
            shape = tuple(shape[:-1]) + (shape[-1] // self.grid.axes[self.boundary_axis],)
        if self.layout.only is not None and self.grid.coords[self.layout.only[0]] != self.layout.only[1]:
            shape = (0,) + tuple(shape[1:])
        return tuple(shape)

    def forward(self, x, documents=None):
        """documents: the (batch, seq) ids of this replica's micro-batch of packed documents (every
        stage is given them: its attention masks by them), or them packed with their chunk order
        (pack), or None. loss() and full_logits() read this micro-batch's order."""
        self._order = order_of(documents)
        if self.embed is not None:
            ids = ids_of(documents)
            if self.seq is None:
                x = self.embed(x, ids)
            else:  # this rank's tokens at their global positions
                length = x.shape[1]
                pos = self.shard_tokens(torch.arange(length, device=x.device).expand(1, length), self._order)[0]
                x = self.embed(self.shard_tokens(x, self._order), ids, pos, length)
            self._full = tuple(x.shape)
            x = _ToLayout.apply(x, self.inner, self.grid)
        elif self.boundary_axis is not None:  # 1/t from each tensor rank of the previous stage
            x = gather_from_parallel(x, self.grid, self.boundary_axis, -1)
        x = run_layers(self.layers, x, self.ac, documents)
        if self.head is None and self.boundary_axis is not None:  # send only this rank's 1/t
            return scatter_to_parallel(x, self.grid, self.boundary_axis, -1)
        if self.head is not None:
            shape = self._full if self.embed is not None else self._step_full or self._full_shape(x)
            x = _FromLayout.apply(x, self.inner, self.grid, shape)
            x = x if self.fused_loss else self.head(x)
        return x

    def _full_shape(self, x):
        """This rank's sequence shard's shape from a local shard (the last stage did not see the
        embedding)."""
        sizes = list(self.inner.global_shape(x.shape[:3], self.grid))
        if self.layout.only is not None:  # cSub: sub-grid 0 knows the batch; tell the others
            sizes = self.grid.broadcast_ints(sizes, self.layout.only[0], self.layout.only[1])
        return tuple(sizes)

    def comm_lines(self) -> list:
        """The lines beyond the grid's axes its layers run collectives over (Grid.connect items):
        what each module that declares comm_lines() names (line parts, tuples of axes)."""
        ends = self.inner.lines(self.grid) if self.embed is not None or self.head is not None else []
        return ends + [item for m in self.modules() if m is not self and hasattr(m, "comm_lines")
                       for item in m.comm_lines()]

    def shard_units(self) -> list:
        """ZeRO-3's units in forward order (FSDP2's per-block units): the embedding, each transformer
        layer, the head."""
        return [m for m in (self.embed, *self.layers, self.head) if m is not None]

    def dense_state(self, pick=False) -> dict:
        """This stage's tensors under the dense GPT's names (collective over the tp group)."""
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

    def moe_layers(self) -> list:
        """The model's indices of this stage's mixture-of-experts layers, in module order."""
        return [i for i, layer in zip(self.first, self.layers) if layer.arch.moe is not None]

    def balancing_biases(self) -> list:
        """(dense name, tensor) of this stage's balancing biases (DeepSeek-V3's, replicated): state
        beside the parameters that checkpoints keep."""
        return [(f"layers.{i}.{layer.dense_name(k)}", b) for i, layer in zip(self.first, self.layers)
                for k, b in balancing_biases(layer)]

    def load_dense_state(self, state: dict):
        """Load this stage's tensors from dense ones (a local slicing: no communication)."""
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
    """This rank's v model chunks for the interleaved schedule (Megatron-LM Fig. 4): chunk c is
    virtual stage c * stages + stage of v * stages (a GPTStage each), so every rank holds v
    thinner slices of the model and the pipeline bubble shrinks v-fold. gw.pipeline
    .pipeline_step runs them with schedule "interleaved"."""

    def __init__(self, gpt: GPT, grid, mode, stage: int, stages: int, chunks: int, placement=Placement.LOOP,
                 **stage_options):
        super().__init__()
        if not isinstance(chunks, int) or chunks < 1:
            raise GridError(f"chunks must be a positive integer, got {chunks!r}")
        if placement is Placement.V and chunks != 2:
            raise GridError(f"a V places 2 model chunks on each stage, got {chunks}")
        if len(gpt.layers) % (chunks * stages):
            raise GridError(f"{len(gpt.layers)} layers do not split into {chunks} chunks on each of {stages} "
                            "pipeline stages")
        # Loop: chunk c is virtual stage c p + s; V (ZB-V, DualPipeV): chunk 1 is 2p - 1 - s, back towards stage 0
        virtual = [stage, 2 * stages - 1 - stage] if placement is Placement.V else \
            [c * stages + stage for c in range(chunks)]
        self.placement = placement
        self.chunks = nn.ModuleList(GPTStage(gpt, grid, mode, u, chunks * stages, **stage_options) for u in virtual)

    def loss(self, logits, targets, normalizer=None):
        return self.chunks[-1].loss(logits, targets, normalizer)

    def pack(self, documents):
        return self.chunks[0].pack(documents)

    @property
    def loss_partial(self) -> tuple:
        return self.chunks[-1].loss_partial

    def activation_shape(self, batch: int, seq: int) -> tuple:
        return [c.activation_shape(batch, seq) for c in self.chunks][0]  # each chunk learns the step's shape

    def sharded_items(self) -> list:
        return [item for c in self.chunks for item in c.sharded_items()]

    def balancing_biases(self) -> list:
        return [item for c in self.chunks for item in c.balancing_biases()]

    def moe_layers(self) -> list:
        return [i for c in self.chunks for i in c.moe_layers()]

    def shard_units(self) -> list:
        return [u for c in self.chunks for u in c.shard_units()]

    def comm_lines(self) -> list:
        return [item for c in self.chunks for item in c.comm_lines()]

    def dense_state(self, pick=False) -> dict:
        return {k: v for c in self.chunks for k, v in c.dense_state(pick).items()}

    def load_dense_state(self, state: dict):
        for c in self.chunks:
            c.load_dense_state(state)

    def forward(self, x):
        raise GridError("model chunks run through gw.pipeline.pipeline_step(..., schedule='interleaved')")
