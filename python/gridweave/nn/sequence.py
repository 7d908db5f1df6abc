"""Sequence parallelism helpers (Li et al.): replicated linears and layer norms, and the
token-mean loss that makes the gradient sum exact.

Convention (the usual source of silent bugs): each rank's loss is the SUM of its local
token losses divided by the GLOBAL token count (global_token_mean); every gradient is then
the SUM of the ranks' gradients over its placement's partial axes (gw.reduce_gradients).
Averaging local means, or averaging gradients over sp, is wrong whenever ranks hold
different token counts, and off by a factor N_sp otherwise.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from .. import split
from ..autograd.ring import positions, ring_attention, ring_self_attention
from ..autograd.ulysses import ulysses_attention, usp_attention
from ..documents import check_documents, document_positions, ids_of, order_of
from ..errors import GridError
from ..grid import LinePart, Span
from ..layout import zigzag_order
from ..sharding import DATA_AXES, place, present_axes
from .dense import GPT2, Arch, Norm, attention, linear_tensors, split_heads, values


class ReplicatedLinear(nn.Linear, split.Deferrable):
    """A torch Linear whose weights every rank holds (sequence and data parallel); its
    gradients are partial sums over `partial`."""

    FLOAT8 = True  # its products in float8 when given a recipe (gw.float8.convert)
    FLOAT8_GATHER = True  # one weight: ZeRO-3 may gather it in float8 (gw.float8.gathered_weights)
    float8 = None

    def __init__(self, in_features, out_features, bias=True, dtype=None, device=None, partial=DATA_AXES):
        super().__init__(in_features, out_features, bias, dtype=dtype, device=device)
        for p in self.parameters():
            place(p, partial=partial)

    def forward(self, x):
        return split.linear(x, self.weight, self.bias, self.weight_store, self.float8)

    def load_dense(self, dense: nn.Linear, order=None):
        w, b = linear_tensors(dense, order)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None:
                self.bias.copy_(b)

    def dense_state(self, grad=False):
        pick = values(grad)
        out = {"weight": pick(self.weight).clone()}
        if self.bias is not None:
            out["bias"] = pick(self.bias).clone()
        return out


class _ReplicatedNorm:
    """load_dense / dense_state of a torch norm every rank of the tensor group holds."""

    def load_dense(self, dense: nn.Module):
        with torch.no_grad():
            for name, t in self.named_parameters():
                t.copy_(getattr(dense, name))

    def dense_state(self, grad=False):
        pick = values(grad)
        return {name: pick(t).clone() for name, t in self.named_parameters()}


class ReplicatedLayerNorm(_ReplicatedNorm, nn.LayerNorm):
    """A torch LayerNorm every rank of the tensor group holds (1-D, sequence, sub-graph)."""

    def __init__(self, hidden, eps=1e-5, dtype=None, device=None, partial=DATA_AXES):
        super().__init__(hidden, eps=eps, dtype=dtype, device=device)
        for p in self.parameters():
            place(p, partial=partial)


class ReplicatedRMSNorm(_ReplicatedNorm, nn.RMSNorm):
    """A torch RMSNorm every rank of the tensor group holds (1-D, sequence, sub-graph)."""

    def __init__(self, hidden, eps=1e-6, dtype=None, device=None, partial=DATA_AXES):
        super().__init__(hidden, eps=eps, dtype=dtype, device=device)
        for p in self.parameters():
            place(p, partial=partial)


def replicated_norm(norm: Norm, hidden, eps, dtype=None, device=None, partial=DATA_AXES):
    cls = ReplicatedRMSNorm if norm is Norm.RMS else ReplicatedLayerNorm
    return cls(hidden, eps=eps, dtype=dtype, device=device, partial=partial)


def global_token_mean(local_sum: torch.Tensor, local_count: int, grid, axes=DATA_AXES) -> torch.Tensor:
    """This rank's share of the mean over every token of the global batch."""
    axes = present_axes(grid, axes)
    total = torch.tensor([float(local_count)], dtype=torch.float64, device=grid.device)
    if axes:
        grid.all_reduce(total, axis=axes)
    return local_sum / total.item()


def sequence_parallel(grid) -> bool:
    return grid.axes.get("sp", 1) > 1


class SeqAttention(enum.Enum):
    """How attention runs where the grid splits the sequence over "sp"."""
    RING = "ring"  # the blockwise ring (online softmax), zigzag when causal
    RSA = "rsa"  # Li et al.'s Ring Self-Attention, as written
    ULYSSES = "ulysses"  # DeepSpeed-Ulysses: all-to-all to head shards around the attention core
    USP = "usp"  # Ulysses inside blocks of ulysses_degree sp ranks, the zigzag ring across the blocks
    LINFORMER = "linformer"  # Li et al. §4.3: E_i K_i, F_i V_i of each shard all-reduced over sp (a Linformer model's)

    @classmethod
    def of(cls, name) -> "SeqAttention":
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise GridError(f"attention must be one of {[a.value for a in cls]}, got {name!r}") from None

    def zigzag(self, causal: bool) -> bool:
        """Whether the sequence shards are in zigzag order: causal ring attention balances its
        load so (RSA and Ulysses keep contiguous shards)."""
        return self in (SeqAttention.RING, SeqAttention.USP) and causal

    def ring(self, sp: int, ulysses_degree: int) -> int | None:
        """The zigzag's ring when it is not all of sp's ranks: USP's blocks."""
        return sp // ulysses_degree if self is SeqAttention.USP else None

    def check(self, sp: int, ulysses_degree: int, local_heads: int) -> None:
        """A GridError unless this attention splits `local_heads` heads over sp (before anything runs)."""
        if self is SeqAttention.USP:
            if ulysses_degree < 1 or sp % ulysses_degree:
                raise GridError(f"attention=usp needs ulysses_degree dividing sp {sp}, got {ulysses_degree}")
        elif ulysses_degree != 1:
            raise GridError(f"ulysses_degree is USP's (attention=usp), got {ulysses_degree} with attention={self.value}")
        split = sp if self is SeqAttention.ULYSSES else ulysses_degree if self is SeqAttention.USP else 1
        if sp > 1 and local_heads % split:
            raise GridError(f"attention={self.value} splits each tensor group's {local_heads} heads over {split} "
                            f"sequence ranks: they do not divide (fewer sequence ranks, or attention=ring)")


def usp_positions(length_local: int, sp: int, index: int, ring: int, causal: bool, device) -> torch.Tensor:
    """Global positions of a rank's shard under USP: the sequence in zigzag order over the ring's
    blocks (causal), split in sp contiguous pieces."""
    if not causal:
        return torch.arange(index * length_local, (index + 1) * length_local, device=device)
    return zigzag_order(length_local * sp, ring, device)[index * length_local:(index + 1) * length_local]


def shard_positions(order, length_local: int, index: int, device) -> torch.Tensor:
    """Global positions of sp rank `index`'s shard under a ChunkOrder over the ring's members (each
    member's sequence cut in contiguous pieces over its ranks: USP's Ulysses blocks)."""
    perm = order.permutation(device)
    return perm[index * length_local:(index + 1) * length_local]


def usp_parts(ulysses_degree: int) -> tuple:
    """USP's two halves of the sp line: its Ulysses blocks of ulysses_degree ranks and the ring
    across them (Fang & Zhao 2024)."""
    return LinePart(("sp",), Span.WITHIN, ulysses_degree), LinePart(("sp",), Span.ACROSS, ulysses_degree)


def attention_lines(grid, algorithm, ulysses_degree: int = 1) -> list:
    """The lines attend() runs `algorithm` over on this grid (Grid.connect items)."""
    if not sequence_parallel(grid):
        return []
    return ["sp", *usp_parts(ulysses_degree)] if SeqAttention.of(algorithm) is SeqAttention.USP else ["sp"]


def attend(qkv, heads, causal, grid, algorithm=SeqAttention.RING, kv_heads=None, arch: Arch = GPT2,
           ulysses_degree: int = 1, documents=None):
    """Attention of the local heads of a packed [q | k | v] (heads query and kv_heads key/value
    heads): on this rank alone, or over "sp" when the grid splits the sequence (the blockwise
    ring, zigzag when causal; RSA; Ulysses; USP with Ulysses inside blocks of ulysses_degree
    ranks). Rotary positions are the tokens' global ones. documents: the (b, L) document ids
    of the whole sequence of this rank's rows (packed documents: attention within each, rotary
    positions restarting at each)."""
    kv_heads = heads if kv_heads is None else kv_heads
    if not sequence_parallel(grid):
        return attention(qkv, heads, causal, kv_heads, arch, documents=ids_of(documents))
    algorithm = SeqAttention.of(algorithm)
    check_shards(qkv.shape[0], qkv.shape[1], grid, algorithm, documents)
    # only rotary embeddings need the global positions
    pos = shard_positions_of(qkv.shape[0], qkv.shape[1], grid, algorithm, causal, ulysses_degree, documents) \
        if arch.rope_theta is not None else None
    # Ulysses and USP send grouped key/value heads as they are (the ring's blocks need them repeated)
    grouped = algorithm in (SeqAttention.ULYSSES, SeqAttention.USP)
    q, k, v = split_heads(qkv, heads, kv_heads, arch, pos, repeat_kv=not grouped)
    o = attend_heads(q, k, v, causal, grid, algorithm, ulysses_degree, documents)
    b, s = qkv.shape[:2]
    return o.transpose(1, 2).reshape(b, s, -1)


def shard_positions_of(b: int, length_local: int, grid, algorithm: SeqAttention, causal: bool, ulysses_degree: int,
                       documents=None) -> torch.Tensor:
    """The global positions of this sp rank's tokens as `algorithm` shards the sequence ((L/N,), or
    (b, L/N) within packed documents: restarting at each). Checks them first (check_shards)."""
    check_shards(b, length_local, grid, algorithm, documents)
    order, ids = order_of(documents), ids_of(documents)
    sp, index = grid.axes["sp"], grid.index("sp")
    device = grid.device
    if order is not None:
        pos = shard_positions(order, length_local, index, device)
    elif algorithm is SeqAttention.USP:
        pos = usp_positions(length_local, sp, index, sp // ulysses_degree, causal, device)
    else:
        pos = positions(length_local, sp, index, algorithm.zigzag(causal), device)
    return pos if ids is None else document_positions(ids)[:, pos]


def check_shards(b: int, length_local: int, grid, algorithm: SeqAttention, documents=None) -> None:
    """A GridError unless packed documents (ids, or ids and a chunk order) fit b rows of this sp
    rank's shards and a chunk order is the ring's or USP's."""
    ids = ids_of(documents)
    if ids is not None:
        check_documents(ids, b, length_local * grid.axes["sp"])
    if order_of(documents) is not None and algorithm not in (SeqAttention.RING, SeqAttention.USP):
        raise GridError(f"a chunk order balances the ring's shards; attention={algorithm.value} keeps its own")


def check_latent_attention(algorithm: SeqAttention, mla) -> None:
    """A GridError unless `algorithm` runs DeepSeek's latent attention (arch.mla) over sp: the ring
    and USP take values no wider than the queries (padded to them: attend_heads), Ulysses any;
    RSA (equal widths, whole score rows) and Linformer (a model of its own) none."""
    if algorithm in (SeqAttention.RSA, SeqAttention.LINFORMER):
        raise GridError(f"multi-head latent attention over sp runs with attention ring, ulysses or usp, not "
                        f"{algorithm.value}")
    if algorithm is not SeqAttention.ULYSSES and mla.v > mla.nope + mla.rope:
        raise GridError(f"attention={algorithm.value} pads the values to the queries' width: v_dim {mla.v} is wider "
                        f"than qk_nope_dim + qk_rope_dim = {mla.nope + mla.rope} (use attention=ulysses)")


def check_latent_layout(layout, what: str) -> tuple:
    """A GridError unless DeepSeek's latent attention can run on a layer input in `layout`: its
    sequence split over sp and Megatron-SP's tp pieces alone, each token's hidden vector whole.
    The pieces its up projections gather (tp's under tp_sp)."""
    seq = tuple(layout.dims[1]) if len(layout.dims) > 1 else ()
    if any(a not in ("sp", "tp") for a in seq) or any(layout.dims[2:]):
        raise GridError(f"multi-head latent attention runs with the sequence split over sp (and tp_sp's pieces) "
                        f"alone and each token's hidden vector whole (tp none or row:N): {what} splits them "
                        "otherwise")
    return tuple(a for a in seq if a not in DATA_AXES)


def attend_heads(q, k, v, causal, grid, algorithm: SeqAttention, ulysses_degree: int = 1, documents=None):
    """Attention over "sp" of this rank's shard of q (b, heads, L/N, d), k (b, kv_heads, L/N, d)
    and v (b, kv_heads, L/N, d_v), rotated already: (b, heads, L/N, d_v). The ring's block kernels
    (torch's fused ones) take one head width: values narrower than the queries (DeepSeek's latent
    attention: 128 against 192) go padded with zero columns, dropped from the output; the softmax
    scale stays the queries' width's."""
    order, ids = order_of(documents), ids_of(documents)
    width = v.shape[-1]
    ring = algorithm in (SeqAttention.RING, SeqAttention.USP, SeqAttention.RSA)
    if ring and width != q.shape[-1]:
        if width > q.shape[-1] or algorithm is SeqAttention.RSA:
            raise GridError(f"attention={algorithm.value} with values {width} wide and queries {q.shape[-1]}: "
                            "the ring takes values no wider than the queries (and RSA equal ones)")
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
    if algorithm is SeqAttention.RSA:
        o = ring_self_attention(q, k, v, grid, "sp", causal, ids)
    elif algorithm is SeqAttention.ULYSSES:
        o = ulysses_attention(q, k, v, grid, "sp", causal, ids)
    elif algorithm is SeqAttention.USP:
        o = usp_attention(q, k, v, grid, *usp_parts(ulysses_degree), causal, ids, order)
    else:
        o = ring_attention(q, k, v, grid, "sp", causal, algorithm.zigzag(causal), documents=ids, order=order)
    return o[..., :width] if o.shape[-1] != width else o
