"""DeepSpeed-Ulysses (Jacobs et al. 2023, §3.1): attention over a sequence split on `axis` by two
all-to-alls around the attention core. Each rank holds all heads of its sequence shard; the
all-to-all trades them for all tokens of 1/N of the heads, attention runs locally on whole
sequences, and the inverse all-to-all brings the output back to sequence shards. Per layer
forward: 4 all-to-alls (q, k, v, out) of B·(L/N)·H values each per rank. USP composes it with the
ring: Ulysses inside blocks of sp ranks, the ring across them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..documents import check_documents, document_mask
from ..errors import GridError
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


def ulysses_attention(q, k, v, grid, axis="sp", causal=False, documents=None):
    """Attention of q, k, v (b, heads, s, d): this rank's contiguous sequence shard, every head
    (key/value heads expanded to the query heads, as gw.nn.dense.split_heads gives them, so a
    key/value head count below N needs nothing more). Returns (b, heads, s, d) of this shard.
    documents: the (b, L) document ids of the whole sequence (packed documents)."""
    n = grid.size(axis)
    if q.shape[1] % n:
        raise GridError(f"Ulysses splits the {q.shape[1]} attention heads of a rank over the {n} ranks of "
                        f"axis {axis!r}: they do not divide")
    if documents is not None:
        check_documents(documents, q.shape[0], q.shape[2] * n)
    q, k, v = (seq_to_heads(t, grid, axis) for t in (q, k, v))
    if documents is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # whole sequences: the fused kernel
    else:
        pos = torch.arange(q.shape[2], device=q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents, pos, pos, causal))
    return heads_to_seq(o, grid, axis)


def usp_attention(q, k, v, grid, inner, outer, causal=False, documents=None):
    """USP (Fang & Zhao 2024; yunchang's LongContextAttention, Megatron's a2a+p2p): Ulysses over
    `inner` (a block of U consecutive sp ranks), the zigzag ring over `outer` (the blocks: R).
    This rank holds piece u of its block's chunk pair (chunks r and 2R-1-r of 2R, causal); the
    all-to-all gathers the pair for 1/U of the heads, the ring attends over the R pairs, and the
    inverse all-to-all returns this rank's piece of every head."""
    u = grid.size(inner)
    if q.shape[1] % u:
        raise GridError(f"USP splits the {q.shape[1]} attention heads of a rank over its Ulysses degree {u}: "
                        "they do not divide")
    if u > 1:
        q, k, v = (seq_to_heads(t, grid, inner) for t in (q, k, v))
    o = ring_attention(q, k, v, grid, outer, causal, zigzag=causal, documents=documents)
    return heads_to_seq(o, grid, inner) if u > 1 else o
