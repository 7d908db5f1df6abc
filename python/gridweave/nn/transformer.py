"""A transformer layer in every tensor-parallel mode, checked against DenseTransformerLayer.

The mode object (gridweave/modes/) makes each piece: gw.Row (Megatron 1-D: column- then
row-parallel, four all-reduces per layer), gw.Square (SUMMA), gw.Cube (Bian et al. Fig. 6:
the first linear of a block swaps the directions, the second swaps them back), gw.SubGraph
and gw.CSub (SUPER's branches), gw.Sequence (replicated weights, ring attention).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import split
from ..autograd.comm import all_reduce_replicated, copy_to_parallel, gather_sequence
from ..documents import document_rows, ids_of, with_ids
from ..errors import GridError
from ..layout import Layout, gather, scatter
from ..sharding import DATA_AXES, group_order, place, placement_of, present_axes, set_row_order
from .dense import (GPT2, Arch, DenseMLA, DenseMLP, DenseSelfAttention, DenseTransformerLayer, Norm,
                    linformer_attention, linformer_keys, mla_attention, mla_heads, qk_normed, split_heads, values)
from .moe import ExpertParallelMoE, expert_line
from .sequence import (ReplicatedLinear, SeqAttention, attend, attend_heads, attention_lines,
                       check_latent_attention, check_latent_layout, sequence_parallel, shard_positions_of)
from .style import resolve


class SelfAttention(nn.Module, split.Deferrable):
    """qkv -> attention on this rank's heads -> proj. Heads are split over the tensor-
    parallel groups (1-D: tp; 2-D: c; 3-D: the a direction of the qkv output); with
    grouped-query attention each group holds kv_heads / groups key/value heads (Megatron-
    Core's rule: the groups must divide kv_heads; kv heads are not replicated)."""

    def __init__(self, hidden, heads, grid, mode=None, bias=True, causal=True, overlap=False, dtype=None,
                 attention="ring", device=None, arch: Arch | None = None, ulysses_degree: int = 1):
        super().__init__()
        self.attention = SeqAttention.of(attention)
        self.ulysses_degree = ulysses_degree
        self.mode = resolve(mode, grid)
        self.groups = self.mode.head_groups_count()
        self.arch = arch = arch or GPT2
        arch.check_causal(causal)
        if arch.linformer is not None:  # the model decides: its attention is Linformer's
            if self.attention not in (SeqAttention.RING, SeqAttention.LINFORMER):
                raise GridError(f"a Linformer model's attention is attention='linformer', got {self.attention.value!r}")
            self.attention = SeqAttention.LINFORMER
        elif self.attention is SeqAttention.LINFORMER:
            raise GridError("attention='linformer' needs a Linformer model (Arch(linformer=(K, L)); --linformer-k K)")
        self.kv_heads = arch.kv(heads)
        if heads % self.groups or self.kv_heads % self.groups:
            if self.kv_heads == heads:
                raise GridError(f"{heads} heads do not split over {self.groups} tensor-parallel groups ({self.mode!r})")
            raise GridError(f"{heads} heads ({self.kv_heads} key/value heads) do not split over {self.groups} "
                            f"tensor-parallel groups ({self.mode!r}); gridweave does not replicate key/value heads: "
                            f"choose a tensor size that divides {self.kv_heads}")
        self.grid, self.bias = grid, bias
        self.hidden, self.heads, self.causal = hidden, heads, causal
        self.widths = arch.qkv_widths(hidden, heads)
        first, second = self.mode.linear_pair(grid, bias, dtype, device or grid.device, overlap)
        if arch.qkv_bias and not bias:  # Qwen2's: the first linear alone has biases
            first = self.mode.linear_pair(grid, True, dtype, device or grid.device, overlap)[0]
        self.qkv, self.proj = first(hidden, sum(self.widths)), second(hidden, hidden)
        set_row_order(self.qkv.weight, self.widths, self.groups)
        set_row_order(self.qkv.bias, self.widths, self.groups)
        self.q_norm, self.k_norm = arch.make_qk_norms(hidden, heads, dtype, device or grid.device)
        if self.q_norm is not None:
            self._place_qk_norms()
        self.attention.check(grid.axes.get("sp", 1), ulysses_degree, heads // self.groups)
        self.lowrank = None
        if arch.linformer is not None:
            # E and F split by columns as the sequence is (Li et al. §4.3: every term in L over N);
            # a rank's gradient covers its rows and its heads, so it is partial over the other
            # data and tensor axes
            self._lowrank_layout = seq = self._linformer_layout()
            self._lowrank_axes = present_axes(grid, seq.axes())  # the partials' sum
            dense = arch.make_lowrank(dtype, device or grid.device)
            self.lowrank = nn.Parameter(scatter(dense.detach(), seq, grid))
            split = set(seq.axes())
            place(self.lowrank, seq, partial=tuple(a for a in DATA_AXES + tuple(a for a, _ in self.mode.axes())
                                                   if a not in split))

    def _place_qk_norms(self) -> None:
        """The per-head norms are every head's: replicated, each rank's gradient its own heads'
        and tokens' (partial over the data axes and the axes that split the heads). Where the
        qkv projection splits more than its output rows (2-D, 3-D) that is not worked out."""
        pl = placement_of(self.qkv.weight)
        if pl.transposed or pl.diagonal is not None or any(pl.layout.dims[1:]):
            raise GridError(f"per-head query/key norms (qk_norm, Qwen3's) run with tp none or row:N, not "
                            f"{self.mode!r}")
        partial = DATA_AXES + tuple(pl.layout.axes())
        for p in (self.q_norm, self.k_norm):
            place(p, partial=partial)

    def _linformer_layout(self) -> Layout:
        """How E and F (2, K, L) split: their columns over the axes that split the sequence the
        attention sees (the layer's, less those its qkv gathers: Megatron's sequence parallelism
        gathers tp's pieces of each sp shard)."""
        def seq(layout):
            return tuple(layout.dims[1]) if len(layout.dims) > 1 else ()

        gathered = seq(getattr(self.qkv, "input_layout", Layout()))
        return Layout((), (), tuple(a for a in seq(self.input_layout) if a not in gathered))

    @property
    def _qkv_layout(self):
        """The layout of the qkv output: the rows (batch, sequence) and heads this rank attends over."""
        return getattr(self.qkv, "output_layout", None) or self.input_layout

    @property
    def input_layout(self):
        return self.mode.layout(self.grid, self.zigzag,
                                self.attention.ring(self.grid.axes.get("sp", 1), self.ulysses_degree))

    output_layout = input_layout

    @property
    def zigzag(self):
        """Causal ring attention balances the load by the zigzag sequence order (RSA and Ulysses do not)."""
        return self.attention.zigzag(self.causal)

    def comm_lines(self) -> list:
        """The lines its attention runs over beyond its mode's axes (Grid.connect items)."""
        return attention_lines(self.grid, self.attention, self.ulysses_degree)

    def forward(self, x, documents=None):
        """documents: the (batch, sequence) ids of this data-parallel replica's whole batch (packed
        documents); this rank's rows are picked by the layout its attention runs in."""
        if self.lowrank is not None:
            if documents is not None:
                raise GridError("Linformer projects the whole sequence: it does not mask packed documents")
            return self.proj(self._linformer(self.qkv(x)))
        if documents is not None:
            documents = with_ids(documents, document_rows(ids_of(documents), self._qkv_layout, self.grid))
        return self.proj(attend(self._normed(self.qkv(x)), self.heads // self.groups, self.causal, self.grid,
                                self.attention, self.kv_heads // self.groups, self.arch, self.ulysses_degree,
                                documents))

    def _normed(self, qkv):
        """This rank's heads' queries and keys normalised (Qwen3's qk_norm), where the arch has it."""
        if self.q_norm is None:
            return qkv
        return split.apart(self.weight_store, lambda t, qn, kn: qk_normed(t, self.heads // self.groups,
                                                                          self.kv_heads // self.groups, qn, kn,
                                                                          self.arch.eps),
                           qkv, self.q_norm, self.k_norm)

    def _linformer(self, qkv):
        """Li et al. §4.3 (Table 3): this rank projects its L/N keys and values with its L/N columns
        of E and F; the partial products are summed over the axes that split the sequence."""
        if self.lowrank.shape[-1] != qkv.shape[1]:
            raise GridError(f"this Linformer projects {self.arch.linformer[1]} tokens ({self.lowrank.shape[-1]} "
                            f"here); the sequence has {qkv.shape[1]} here")
        q, k, v = split_heads(self._normed(qkv), self.heads // self.groups, self.kv_heads // self.groups, self.arch)
        axes = self._lowrank_axes
        total = (lambda t: all_reduce_replicated(t, self.grid, axes)) if axes else None
        o = linformer_attention(q, k, v, self.lowrank, total,  # E and F's gradients wait for W with the linears'
                                lambda kv, e: split.apart(self.weight_store, linformer_keys, kv, e))
        b, s = qkv.shape[:2]
        return o.transpose(1, 2).reshape(b, s, -1)

    @classmethod
    def from_dense(cls, dense: DenseSelfAttention, grid, mode=None, **kw):
        kw.setdefault("dtype", dense.qkv.weight.dtype)
        m = cls(dense.qkv.in_features, dense.heads, grid, mode, bias=dense.proj.bias is not None, causal=dense.causal,
                arch=dense.arch, **kw)
        m.load_dense(dense.qkv, dense.proj, dense.lowrank, dense.q_norm, dense.k_norm)
        return m

    def to_dense(self):
        w = self.qkv.weight
        d = DenseSelfAttention(self.hidden, self.heads, self.bias, self.causal, dtype=w.dtype, device=w.device,
                               arch=self.arch)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d

    def load_dense(self, qkv: nn.Linear, proj: nn.Linear, lowrank=None, q_norm=None, k_norm=None):
        self.qkv.load_dense(qkv, group_order(self.widths, self.groups, qkv.weight.device))
        self.proj.load_dense(proj)
        with torch.no_grad():
            if self.lowrank is not None:
                self.lowrank.copy_(scatter(lowrank.detach(), self._lowrank_layout, self.grid))
            if self.q_norm is not None:
                self.q_norm.copy_(q_norm)
                self.k_norm.copy_(k_norm)

    def dense_state(self, grad=False):
        out = {f"qkv.{k}": v for k, v in self.qkv.dense_state(grad).items()}
        out.update({f"proj.{k}": v for k, v in self.proj.dense_state(grad).items()})
        if self.lowrank is not None:
            out["lowrank"] = gather(values(grad)(self.lowrank).contiguous(), self._lowrank_layout, self.grid)
        if self.q_norm is not None:
            out.update(q_norm=values(grad)(self.q_norm).clone(), k_norm=values(grad)(self.k_norm).clone())
        inv = torch.argsort(group_order(self.widths, self.groups, out["qkv.weight"].device))
        for k in ("qkv.weight", "qkv.bias"):
            if k in out:
                out[k] = out[k][inv]
        return out


class RingSelfAttention(SelfAttention):
    """Li et al.'s Ring Self-Attention block: qkv and proj replicated, RSA over "sp"."""

    def __init__(self, hidden, heads, grid, causal=False, bias=True, dtype=None, device=None):
        super().__init__(hidden, heads, grid, "sp", bias, causal, dtype=dtype, attention="rsa", device=device)

    @classmethod
    def from_dense(cls, dense: DenseSelfAttention, grid):
        if dense.arch.rope_theta is not None or dense.kv_heads != dense.heads:
            raise GridError(f"{cls.__name__} is Li et al.'s block (MHA, no rotary); use "
                            f"SelfAttention(..., mode=gw.Sequence(), arch=...) for this one")
        m = cls(dense.qkv.in_features, dense.heads, grid, dense.causal, dense.qkv.bias is not None,
                dense.qkv.weight.dtype)
        m.load_dense(dense.qkv, dense.proj)
        return m


class RingAttention(SelfAttention):
    """Blockwise ring attention block (online softmax; zigzag sequence layout when causal)."""

    def __init__(self, hidden, heads, grid, causal=True, bias=True, dtype=None, device=None):
        super().__init__(hidden, heads, grid, "sp", bias, causal, dtype=dtype, attention="ring", device=device)

    from_dense = RingSelfAttention.__dict__["from_dense"]


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (DeepSeek-V2 §2.1) on a grid, as Megatron-Core's MLA
    splits it: the down projections and the latents' RMSNorms replicated (every rank of the tensor
    group runs them on the same tokens), the up projections the mode's first linear (1-D: column
    parallel, each rank a block of whole heads, f on its latent), the output projection its second
    (row parallel, g); the rotary key every head shares goes through f too. With Megatron's
    sequence parallelism (row:N, tp_sp) the down projections and latent norms run on this rank's
    sequence piece (their gradients partial over tp), the up projections all-gather the latents,
    the rotary key is all-gathered (reduce-scattered backward) and the output projection
    reduce-scatters, as Megatron-Core's MLA does. Where sp splits the sequence, every projection
    is the token's own: the queries, keys and values of this rank's shard (the rotary parts at
    their global positions) meet over sp in `attention` (the ring, its values padded to the
    queries' width; Ulysses; USP). Heads split over at most one axis by output rows (tp none or
    row:N); RSA and the 2-D, 3-D and sub-graph modes: one clear error."""

    def __init__(self, hidden, heads, grid, mode=None, causal=True, dtype=None, device=None, arch: Arch | None = None,
                 attention="ring", ulysses_degree: int = 1):
        super().__init__()
        self.mode = resolve(mode, grid)
        self.grid, self.hidden, self.heads, self.causal, self.arch = grid, hidden, heads, causal, arch
        m = self.mla = arch.mla
        device = device or grid.device
        self.groups = self.mode.head_groups_count()
        if heads % self.groups:
            raise GridError(f"{heads} latent-attention heads do not split over {self.groups} tensor-parallel groups")
        self.attention, self.ulysses_degree = SeqAttention.of(attention), ulysses_degree
        sp = grid.axes.get("sp", 1)
        self.attention.check(sp, ulysses_degree, heads // self.groups)
        if sp > 1:
            check_latent_attention(self.attention, m)
        # Megatron-SP: the pieces of the sequence the up projections gather (tp's), where the
        # replicated projections and norms run on distinct tokens
        self._gathered = check_latent_layout(self.input_layout, f"{self.mode!r} on {dict(grid.axes)}")
        first, second = self.mode.linear_pair(grid, False, dtype, device)
        # the down projections see the layer input's tokens, as the mode's norms do: their
        # gradients partial over the axes that split those tokens
        kw = dict(bias=False, dtype=dtype, device=device, partial=DATA_AXES + self._gathered)
        if m.q_rank is None:
            self.q = first(hidden, m.q_width(heads))
        else:
            self.q_down = ReplicatedLinear(hidden, m.q_rank, **kw)
            self.q_norm = self.mode.norm(m.q_rank, grid, dtype, device, m.eps, Norm.RMS)
            self.q_up = first(m.q_rank, m.q_width(heads))
        self.kv_down = ReplicatedLinear(hidden, m.kv_rank + m.rope, **kw)
        self.kv_norm = self.mode.norm(m.kv_rank, grid, dtype, device, m.eps, Norm.RMS)
        self.kv_up = first(m.kv_rank, heads * (m.nope + m.v))
        self.proj = second(heads * m.v, hidden)
        pl = placement_of(self.kv_up.weight)
        if pl.transposed or pl.diagonal is not None or any(pl.layout.dims[1:]) or len(pl.layout.axes()) > 1:
            raise GridError(f"multi-head latent attention splits its heads by the up projections' rows over one axis "
                            f"(tp none or row:N), not {self.mode!r}")
        self._head_axis = pl.layout.axes()[0] if pl.layout.axes() else None  # where the rotary key's f runs

    @property
    def input_layout(self):
        return self.mode.layout(self.grid, self.attention.zigzag(self.causal),
                                self.attention.ring(self.grid.axes.get("sp", 1), self.ulysses_degree))

    output_layout = input_layout

    def comm_lines(self) -> list:
        """The lines its attention runs over beyond its mode's axes (Grid.connect items)."""
        return attention_lines(self.grid, self.attention, self.ulysses_degree)

    def linears(self) -> tuple:
        q = (self.q,) if self.mla.q_rank is None else (self.q_down, self.q_up)
        return q + (self.kv_down, self.kv_up, self.proj)

    def forward(self, x, documents=None):
        """documents: this data-parallel replica's packed documents (ids or Packed): this rank's rows
        of them mask the attention (its sequences are whole here)."""
        m, heads = self.mla, self.heads // self.groups
        latent, k_rope = self.kv_down(x).split([m.kv_rank, m.rope], dim=-1)
        q = self.q(x) if m.q_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        if self._gathered:  # Megatron-SP: the whole (sp shard's) sequence, its gradient reduce-scattered
            (axis,) = self._gathered
            k_rope = gather_sequence(k_rope, self.grid, axis)
        elif self._head_axis is not None:  # every rank's heads read it: its gradient summed over them (f)
            k_rope = copy_to_parallel(k_rope, self.grid, self._head_axis)
        kv = self.kv_up(self.kv_norm(latent))
        if not sequence_parallel(self.grid):
            if documents is not None:
                documents = document_rows(ids_of(documents), self.input_layout, self.grid)
            return self.proj(mla_attention(q, kv, k_rope, heads, m, self.arch.rope_theta, self.causal,
                                           documents=documents))
        if documents is not None:
            documents = with_ids(documents, document_rows(ids_of(documents), self.input_layout, self.grid))
        b, s = q.shape[:2]
        pos = shard_positions_of(b, s, self.grid, self.attention, self.causal, self.ulysses_degree, documents)
        o = attend_heads(*mla_heads(q, kv, k_rope, heads, m, self.arch.rope_theta, pos), self.causal, self.grid,
                         self.attention, self.ulysses_degree, documents)
        return self.proj(o.transpose(1, 2).reshape(b, s, heads * m.v))

    NAMES = ("q", "q_down", "q_norm", "q_up", "kv_down", "kv_norm", "kv_up", "proj")

    def _parts(self):
        return [(n, getattr(self, n)) for n in self.NAMES if hasattr(self, n)]

    def load_dense(self, dense: DenseMLA):
        for name, mod in self._parts():
            mod.load_dense(getattr(dense, name))

    def dense_state(self, grad=False) -> dict:
        """DenseTransformerLayer's tensors of the latent attention (mla.*)."""
        return {f"mla.{name}.{k}": v for name, mod in self._parts() for k, v in mod.dense_state(grad).items()}


class MLP(nn.Module):
    """fc1 -> activation -> fc2 (1-D: column then row parallel; 3-D: directions swap and
    back). SwiGLU's packed [gate | up] is regrouped so each column block holds matching
    gate and up columns (the first linear's columns split like the heads)."""

    def __init__(self, hidden, ffn_hidden, grid, mode=None, bias=True, overlap=False, dtype=None, device=None,
                 arch: Arch | None = None):
        super().__init__()
        self.mode = resolve(mode, grid)
        self.arch = arch or GPT2
        self.grid, self.bias = grid, bias
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.widths = self.arch.fc1_widths(ffn_hidden)
        self.groups = self.mode.head_groups_count()
        first, second = self.mode.linear_pair(grid, bias, dtype, device or grid.device, overlap)
        self.fc1, self.fc2 = first(hidden, sum(self.widths)), second(ffn_hidden, hidden)
        if len(self.widths) > 1:
            set_row_order(self.fc1.weight, self.widths, self.groups)
            set_row_order(self.fc1.bias, self.widths, self.groups)

    @property
    def input_layout(self):
        # token-wise: any sequence order works; the contiguous one is reported
        return self.mode.layout(self.grid, False)

    output_layout = input_layout

    def forward(self, x):
        return self.fc2(self.arch.act(self.fc1(x)))

    @classmethod
    def from_dense(cls, dense: DenseMLP, grid, mode=None, **kw):
        kw.setdefault("dtype", dense.fc1.weight.dtype)
        m = cls(dense.fc1.in_features, dense.fc2.in_features, grid, mode, bias=dense.fc1.bias is not None,
                arch=dense.arch, **kw)
        m.load_dense(dense.fc1, dense.fc2)
        return m

    def _order(self, device):
        return group_order(self.widths, self.groups, device) if len(self.widths) > 1 else None

    def to_dense(self):
        w = self.fc1.weight
        d = DenseMLP(self.hidden, self.ffn_hidden, self.bias, dtype=w.dtype, device=w.device, arch=self.arch)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d

    def load_dense(self, fc1: nn.Linear, fc2: nn.Linear):
        self.fc1.load_dense(fc1, self._order(fc1.weight.device))
        self.fc2.load_dense(fc2)

    def dense_state(self, grad=False):
        out = {f"fc1.{k}": v for k, v in self.fc1.dense_state(grad).items()}
        order = self._order(out["fc1.weight"].device)
        if order is not None:
            inv = torch.argsort(order)
            out = {k: v[inv] for k, v in out.items()}
        out.update({f"fc2.{k}": v for k, v in self.fc2.dense_state(grad).items()})
        return out


class TransformerLayer(nn.Module):
    """Pre-LN layer x + attn(ln1 x), then + mlp(ln2 x), each piece made by the mode object
    (`mode`: gw.Row(n) etc., a layer-mode name, or None for the grid's own tensor mode).
    attention_options go to the mode's attention (sub-graph: projection, method)."""

    def __init__(self, hidden, heads, grid, mode=None, ffn_hidden=None, bias=True, causal=True, overlap=False,
                 dtype=None, attention="ring", device=None, arch: Arch | None = None, ep=None, **attention_options):
        """ep: where the layer's MLP is a mixture of experts (arch.moe), the axis argument its
        experts are split over (a LinePart of the data axes; None: every rank holds them all)."""
        super().__init__()
        self.mode = resolve(mode, grid)
        self.arch = arch = arch or GPT2
        ffn_hidden = ffn_hidden or 4 * hidden
        device = device or grid.device
        self.grid, self.hidden, self.heads, self.causal = grid, hidden, heads, causal
        self.ffn_hidden, self.overlap, self.bias = ffn_hidden, overlap, bias
        if arch.linformer is not None:
            self.mode.check_attention(SeqAttention.LINFORMER)  # SUPER's branches have no Linformer
        self.ln1, self.ln2 = (self.mode.norm(hidden, grid, dtype, device, arch.eps, arch.norm) for _ in range(2))
        if arch.mla is not None:  # DeepSeek's latent attention: its own split (LatentAttention)
            self.attn = LatentAttention(hidden, heads, grid, self.mode, causal, dtype, device, arch, attention,
                                        attention_options.get("ulysses_degree", 1))
        else:
            self.attn = self.mode.attention(hidden, heads, grid, causal, bias, dtype, device, overlap, attention,
                                            arch=arch, **attention_options)
        if arch.moe is None:
            self.mlp = MLP(hidden, ffn_hidden, grid, self.mode, bias, overlap, dtype, device, arch)
        else:
            tokens = self.mode.moe_token_axes()
            if tokens is None:
                raise GridError(f"mixture-of-experts layers need each token's whole hidden vector at the MLP; "
                                f"{self.mode!r} splits it there: use tp none (with dp, sp, pp) or row")
            tp, sequence = self.mode.moe_tensor_axis()
            self.mlp = ExpertParallelMoE(hidden, arch.moe, grid, ep if ep is not None else expert_line(grid, 1),
                                         tokens, dtype, device, tp, sequence)

    @property
    def input_layout(self):
        return self.attn.input_layout

    output_layout = input_layout

    def linears(self):
        attn = self.attn.linears() if self.arch.mla is not None else (self.attn.qkv, self.attn.proj)
        return attn + ((self.mlp.fc1, self.mlp.fc2) if self.arch.moe is None else ())

    def prefetch(self):
        """Start the weight gathers of this layer's linears that can run ahead (3-D: the
        all-gathers in x), async; call it on the next layer while this one computes, or let
        overlap=True do it per layer."""
        for lin in self.linears():
            if hasattr(lin, "prefetch"):
                lin.prefetch()

    def forward(self, x, documents=None):
        """documents: the (batch, sequence) ids of this data-parallel replica's batch of packed
        documents (attention stays within each), or None."""
        if self.overlap:
            self.prefetch()
        if documents is not None and not self.mode.packs_documents:
            raise GridError(f"packed documents: {self.mode!r}'s attention does not mask by documents")
        def attn(h):
            return self.attn(h) if documents is None else self.attn(h, documents)

        if self.arch.post_norm:  # BERT (Devlin et al. 2019): the norms after each residual sum
            x = self.ln1(x + attn(x))
            return self.ln2(x + self.mlp(x))
        x = x + attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    @classmethod
    def from_dense(cls, dense: DenseTransformerLayer, grid, mode=None, **kw):
        hidden = dense.ln1.normalized_shape[0]
        latent = dense.arch.mla is not None
        kw.setdefault("dtype", (dense.mla.kv_down if latent else dense.qkv).weight.dtype)
        m = cls(hidden, dense.heads, grid, mode, ffn_hidden=dense.ffn_hidden,
                bias=not latent and dense.proj.bias is not None, causal=dense.causal, arch=dense.arch, **kw)
        m.load_dense(dense)
        return m

    def load_dense(self, dense):
        if self.arch.mla is not None:
            self.attn.load_dense(dense.mla)
        else:
            self.attn.load_dense(dense.qkv, dense.proj, dense.lowrank, dense.q_norm, dense.k_norm)
        if self.arch.moe is None:
            self.mlp.load_dense(dense.fc1, dense.fc2)
        else:
            self.mlp.load_dense(dense.moe)
        self.ln1.load_dense(dense.ln1)
        self.ln2.load_dense(dense.ln2)

    # this layer's parameter names -> DenseTransformerLayer's (sub-graph branches keep the
    # projection's bias apart as proj_bias)
    DENSE_NAMES = {"attn.qkv.": "qkv.", "attn.proj.": "proj.", "attn.proj_bias": "proj.bias", "mlp.fc1.": "fc1.",
                   "mlp.fc2.": "fc2.", "attn.lowrank": "lowrank", "attn.q_norm": "q_norm", "attn.k_norm": "k_norm",
                   "mlp.": "moe."}  # the last: a mixture of experts

    def dense_name(self, name: str) -> str:
        """DenseTransformerLayer's name of one of this layer's tensors."""
        if self.arch.mla is not None and name.startswith("attn."):  # latent attention: DenseMLA's names
            return "mla." + name[len("attn."):]
        for ours, theirs in self.DENSE_NAMES.items():
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    def dense_named_parameters(self):
        """(DenseTransformerLayer's name, this rank's parameter) pairs."""
        for name, p in self.named_parameters():
            yield self.dense_name(name), p

    def dense_state(self, grad=False):
        """Full tensors under DenseTransformerLayer's names (grad=True: their gradients)."""
        mlp = self.mlp.dense_state(grad)
        if self.arch.moe is not None:
            mlp = {f"moe.{k}": v for k, v in mlp.items()}
        out = {**self.attn.dense_state(grad), **mlp}
        for name in ("ln1", "ln2"):
            out.update({f"{name}.{k}": v for k, v in getattr(self, name).dense_state(grad).items()})
        return out

    def to_dense(self):
        w = next(self.attn.parameters())
        d = DenseTransformerLayer(self.hidden, self.heads, self.ffn_hidden, bias=self.bias, causal=self.causal,
                                  dtype=w.dtype, device=w.device, arch=self.arch)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d
