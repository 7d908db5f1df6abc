"""DeepSpeed-Ulysses (Jacobs et al. 2023, §3.1): attention over a sequence split on `axis` by two
all-to-alls around the attention core. Each rank holds all heads of its sequence shard; the
all-to-all trades them for all tokens of 1/N of the heads, attention runs locally on whole
sequences, and the inverse all-to-all brings the output back to sequence shards. Per layer
forward: 4 all-to-alls (q, k, v, out) of B·(L/N)·H values each per rank. USP composes it with the
ring: Ulysses inside blocks of sp ranks, the ring across them."""
from __future__ import annotations

import math

import torch

from ..documents import check_documents, document_mask
from ..errors import GridError
from .heads import grouped_attention, repeat_kv
from .ring import ring_attention


def _seq_to_heads(x, grid, axis):
    """(b, h, s, d) sequence shard -> (b, h/n, n s, d) head shard: head group j goes to member j,
    sequence shard j comes from member j (in order: the shards are contiguous)."""
    n = grid.size(axis)
    b, h, s, d = x.shape
    t = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    r = grid.all_to_all(t, axis)  # (n: the member it came from = its sequence shard, b, h/n, s, d)
    return r.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x, grid, axis):
    """The inverse: (b, h/n, n s, d) head shard -> (b, h, s, d) sequence shard."""
    n = grid.size(axis)
    b, hn, ns, d = x.shape
    s = ns // n
    t = x.reshape(b, hn, n, s, d).permute(2, 0, 1, 3, 4).contiguous()
    r = grid.all_to_all(t, axis)  # (n: the member it came from = its head group, b, h/n, s, d)
    return r.permute(1, 0, 2, 3, 4).reshape(b, n * hn, s, d)


class _Exchange(torch.autograd.Function):
    """One of the two all-to-alls; its backward is the other (each is the other's inverse)."""

    @staticmethod
    def forward(ctx, x, grid, axis, to_heads):
        ctx.grid, ctx.axis, ctx.to_heads = grid, axis, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, grid, axis)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(g, ctx.grid, ctx.axis), None, None, None


def seq_to_heads(x, grid, axis):
    return _Exchange.apply(x, grid, axis, True)


def heads_to_seq(x, grid, axis):
    return _Exchange.apply(x, grid, axis, False)


def kv_heads_sent(kv_heads: int, n: int) -> int:
    """Key/value heads Ulysses moves over n ranks under grouped-query attention: as they are where
    n divides them, else each repeated to lcm(kv_heads, n), so that each rank receives whole
    groups of its query heads (DeepSpeed-Ulysses replicates them only below n, Jacobs et al. §3.2)."""
    return math.lcm(kv_heads, n)


def _kv_to_send(k, v, n):
    m = kv_heads_sent(k.shape[1], n)
    return repeat_kv(k, m), repeat_kv(v, m)


def _check_heads(q, k, n, axis, what):
    if q.shape[1] % n:
        raise GridError(f"{what} splits the {q.shape[1]} attention heads of a rank over the {n} ranks of "
                        f"axis {axis!r}: they do not divide")
    if q.shape[1] % k.shape[1]:
        raise GridError(f"{k.shape[1]} key/value heads do not group {q.shape[1]} query heads")


def ulysses_attention(q, k, v, grid, axis="sp", causal=False, documents=None):
    """Attention of q (b, heads, s, d) over k, v (b, kv_heads, s, d): this rank's contiguous
    sequence shard, every head; grouped key/value heads are sent as they are where the ranks
    divide them (kv_heads_sent). Returns (b, heads, s, d) of this shard. documents: the (b, L)
    document ids of the whole sequence (packed documents)."""
    n = grid.size(axis)
    _check_heads(q, k, n, axis, "Ulysses")
    if documents is not None:
        check_documents(documents, q.shape[0], q.shape[2] * n)
    k, v = _kv_to_send(k, v, n)
    q, k, v = (seq_to_heads(t, grid, axis) for t in (q, k, v))
    mask = None
    if documents is not None:
        pos = torch.arange(q.shape[2], device=q.device)
        mask = document_mask(documents, pos, pos, causal)
    o = grouped_attention(q, k, v, causal, mask)  # whole sequences: the fused kernel where it can
    return heads_to_seq(o, grid, axis)


def usp_attention(q, k, v, grid, inner, outer, causal=False, documents=None, order=None):
    """USP (Fang & Zhao 2024; yunchang's LongContextAttention, Megatron's a2a+p2p): Ulysses over
    `inner` (a block of U consecutive sp ranks), the zigzag ring over `outer` (the blocks: R).
    This rank holds piece u of its block's chunk pair (chunks r and 2R-1-r of 2R, causal); the
    all-to-all gathers the pair for 1/U of the heads (grouped key/value heads as Ulysses sends
    them), the ring attends over the R pairs (its blocks repeat them to the query heads), and the
    inverse all-to-all returns this rank's piece of every head. order: packed documents' ChunkOrder
    over the R blocks (each block's chunks in place of its zigzag pair)."""
    u = grid.size(inner)
    _check_heads(q, k, u, inner, "USP's Ulysses degree")
    if u > 1:
        k, v = _kv_to_send(k, v, u)
        q, k, v = (seq_to_heads(t, grid, inner) for t in (q, k, v))
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # the ring's blocks take equal heads
    o = ring_attention(q, k, v, grid, outer, causal, zigzag=causal, documents=documents, order=order)
    return heads_to_seq(o, grid, inner) if u > 1 else o
