"""Sequence parallelism on the engine's ring (Li et al.).

RingSelfAttention: the paper's algorithm as written (§3.1): Ring-QK^T assembles this
rank's (L/N x L) score rows, softmax, Ring-AV. Backward: ring V and ring K again, and
two all-reduces of the full-length dK, dV partials: 2(N-1)BZ(L/N)A values forward and
6(N-1)BZ(L/N)A backward per rank, as the paper counts.

RingAttention: blockwise with online softmax (log-sum-exp merge); each block runs on torch's
fused attention kernels, so no block of scores is ever materialised; causal load balancing
by zigzag (rank i holds chunks i and 2N-1-i); backward passes K and V around the ring with
their dK, dV accumulators, which one last step brings home.
"""
from __future__ import annotations

import torch

from .. import _C
from .._buffers import engine_dtype
from ..errors import GridError
from ..documents import check_documents, document_mask


def chunk_starts(length_local: int, n: int, rank: int, zigzag: bool) -> list:
    """(local slice, first global position) of each run of a rank's local sequence that is
    contiguous in global positions (zigzag: chunks rank and 2n-1-rank of 2n)."""
    if not zigzag:
        return [(slice(0, length_local), rank * length_local)]
    c = length_local // 2
    return [(slice(0, c), rank * c), (slice(c, 2 * c), (2 * n - 1 - rank) * c)]


def positions(length_local: int, n: int, rank: int, zigzag: bool, device="cpu") -> torch.Tensor:
    """Global token positions of a rank's local sequence."""
    return torch.cat([torch.arange(g, g + (sl.stop - sl.start), device=device)
                      for sl, g in chunk_starts(length_local, n, rank, zigzag)])


def check_sequence(length_local: int, zigzag: bool):
    if zigzag and length_local % 2:
        raise GridError(f"zigzag ring attention needs an even local sequence (2N chunks), got {length_local}")


# ---------------------------------------------------------------------------------------
# The paper's Ring Self-Attention


class _RingSelfAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, grid, axis, causal, documents):
        ring = grid.ring(axis)
        n, r = ring.size, ring.rank
        B, Z, Lq, A = q.shape
        scale = A ** -0.5
        scores = q.new_empty(B, Z, Lq, n * Lq)
        cur = k
        for s in range(n):  # Ring-QK^T
            ex = ring.pass_on([cur], s) if s < n - 1 else None
            src = ring.source_at(s)
            scores[..., src * Lq:(src + 1) * Lq] = q @ cur.transpose(-1, -2) * scale
            if ex is not None:
                (cur,) = ex.wait()
        qpos = positions(Lq, n, r, False, q.device)
        if documents is not None:  # the paper's scores hold whole rows: mask them (packed documents)
            scores.masked_fill_(~document_mask(documents, qpos, torch.arange(n * Lq, device=q.device), causal),
                                float("-inf"))
        elif causal:
            scores.masked_fill_(torch.arange(n * Lq, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out = torch.zeros_like(q)
        cur = v
        for s in range(n):  # Ring-AV
            ex = ring.pass_on([cur], n + s) if s < n - 1 else None
            src = ring.source_at(s)
            out += p[..., src * Lq:(src + 1) * Lq] @ cur
            if ex is not None:
                (cur,) = ex.wait()
        ctx.save_for_backward(q, k, v, p)  # p is the paper's (B, Z, L/N, L) term
        ctx.grid, ctx.axis = grid, axis
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        grid, ring = ctx.grid, ctx.grid.ring(ctx.axis)
        n, r = ring.size, ring.rank
        dout = dout.contiguous()
        B, Z, Lq, A = q.shape
        scale = A ** -0.5
        dp = torch.empty_like(p)
        dv_full = q.new_zeros(B, Z, n * Lq, A)
        cur = v
        for s in range(n):  # ring V: dP = dO V^T; this rank's share of every dV block
            ex = ring.pass_on([cur], s) if s < n - 1 else None
            src = ring.source_at(s)
            blk = slice(src * Lq, (src + 1) * Lq)
            dp[..., blk] = dout @ cur.transpose(-1, -2)
            dv_full[..., blk, :] = p[..., blk].transpose(-1, -2) @ dout
            if ex is not None:
                (cur,) = ex.wait()
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq = torch.zeros_like(q)
        dk_full = q.new_zeros(B, Z, n * Lq, A)
        cur = k
        for s in range(n):  # ring K: dQ = dS K; this rank's share of every dK block
            ex = ring.pass_on([cur], n + s) if s < n - 1 else None
            src = ring.source_at(s)
            blk = slice(src * Lq, (src + 1) * Lq)
            dq += ds[..., blk] @ cur
            dk_full[..., blk, :] = ds[..., blk].transpose(-1, -2) @ q
            if ex is not None:
                (cur,) = ex.wait()
        grid.all_reduce(dk_full, axis=ctx.axis)  # the paper's two all-reduces
        grid.all_reduce(dv_full, axis=ctx.axis)
        mine = slice(r * Lq, (r + 1) * Lq)
        return dq, dk_full[..., mine, :].contiguous(), dv_full[..., mine, :].contiguous(), None, None, None, None


def ring_self_attention(q, k, v, grid, axis="sp", causal=False, documents=None):
    """Li et al.'s RSA on (batch, heads, L/N, head_dim) shards of contiguous sequence chunks;
    documents: the (batch, L) document ids of the whole sequence (packed documents)."""
    if documents is not None:
        check_documents(documents, q.shape[0], q.shape[2] * grid.size(axis))
    return _RingSelfAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), grid, axis, causal, documents)


# ---------------------------------------------------------------------------------------
# Blockwise ring attention with online softmax


def lse_merge_(out, lse, blk_out, blk_lse):
    """In place: out, lse <- the log-sum-exp merge of (out, lse) and (blk_out, blk_lse).
    On CUDA this is the engine's kernel (cuda/lse_merge.cu); torch elsewhere."""
    if out.is_cuda and out.is_contiguous() and getattr(_C, "cuda_kernels", False):
        rows, dim = lse.numel(), out.shape[-1]
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _C.lse_merge(out.data_ptr(), lse.data_ptr(), blk_out.contiguous().data_ptr(), blk_lse.contiguous().data_ptr(),
                     rows, dim, engine_dtype(out.dtype), stream)
        return
    merged = torch.logaddexp(lse, blk_lse)
    empty = torch.isneginf(merged)
    wa = torch.where(empty, torch.zeros_like(lse), torch.exp(lse - merged))
    wb = torch.where(empty, torch.zeros_like(lse), torch.exp(blk_lse - merged))
    out.mul_(wa.unsqueeze(-1).to(out.dtype)).add_(blk_out * wb.unsqueeze(-1).to(out.dtype))
    lse.copy_(merged)


def _document_bias(documents, qs, q0, ks, k0, causal, dtype):
    """The additive mask (b, 1, lq, lk) of a block whose query rows start at sequence position q0
    and key rows at k0: 0 within a document (and causally visible), -inf elsewhere."""
    qpos = torch.arange(q0, q0 + qs.stop - qs.start, device=documents.device)
    kpos = torch.arange(k0, k0 + ks.stop - ks.start, device=documents.device)
    visible = document_mask(documents, qpos, kpos, causal)
    return torch.zeros(visible.shape, dtype=dtype, device=documents.device).masked_fill_(~visible, float("-inf"))


def _blocks(Lq, n, q_rank, k_rank, zigzag, causal, order=None):
    """(q slice, k slice, diagonal) of every block of scores with a visible pair. The local
    sequence is made of chunks of one partition of the positions, so two chunks overlap only
    when they are the same one: such a block is causal exactly as torch's is_causal (top-left
    aligned); every other visible block is wholly visible. order (a ChunkOrder): the chunks of
    each member, and the blocks with no visible pair of packed documents, skipped. Decided on
    positions as Python ints, so nothing waits on the device."""
    out = []
    if order is not None:
        for qs, q0, qc in order.runs(q_rank):
            for ks, k0, kc in order.runs(k_rank):
                if (causal and k0 > q0) or not order.sees(qc, kc):
                    continue
                out.append((qs, q0, ks, k0, causal and k0 == q0))
        return out
    for qs, q0 in chunk_starts(Lq, n, q_rank, zigzag):
        q1 = q0 + qs.stop - qs.start - 1
        for ks, k0 in chunk_starts(Lq, n, k_rank, zigzag):
            if causal and k0 > q1:
                continue  # nothing visible
            out.append((qs, q0, ks, k0, causal and k0 == q0))
    return out


# Local blocks on torch's fused attention kernels, which return the log-sum-exp and never
# materialise a block of scores: CPU flash attention on the host, memory-efficient attention
# on CUDA for fp32/fp16/bf16 (float64 on CUDA, which it refuses, takes ScoresBlocks). Their
# backward takes the final output and log-sum-exp of the query rows, so one block's dQ, dK,
# dV are exact parts of the whole.


class FusedBlocks:
    """The local block kernels of ring attention: torch's fused attention (the default).
    Another implementation with the same two methods can be passed to ring_attention (the
    benchmarks compare it with materialised scores). bias: an additive (b, 1, Lq, Lk) mask
    (0 or -inf: packed documents), or None."""

    @staticmethod
    def forward(q, k, v, diagonal, scale, bias=None):
        return _block_forward(q, k, v, diagonal, scale, bias)

    @staticmethod
    def backward(dout, q, k, v, out, lse, diagonal, scale, bias=None):
        return _block_backward(dout, q, k, v, out, lse, diagonal, scale, bias)


def _scores_on_cuda(t, bias=None):
    # torch's CUDA memory-efficient attention takes fp32, fp16 and bf16 only; a document mask
    # is applied to materialised scores there (its attn_bias wants aligned strides)
    return t.is_cuda and (t.dtype == torch.float64 or bias is not None)


def _block_scores(q, k, diagonal, scale, bias=None):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:  # top-left aligned, as torch's is_causal
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s if bias is None else s + bias


class ScoresBlocks:
    """The local blocks from their materialised (Lq x Lk) scores: float64 on CUDA (torch's
    fused CUDA kernels refuse it), and the baseline the benchmarks compare FusedBlocks with."""

    @staticmethod
    def forward(q, k, v, diagonal, scale, bias=None):
        s = _block_scores(q, k, diagonal, scale, bias)
        lse = torch.logsumexp(s, dim=-1)  # -inf on a row that sees nothing here (packed documents)
        safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        return torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, diagonal, scale, bias=None):
        # P = exp(S - lse) with the rows' final lse; dS = P * (dP - rowsum(dO * O))
        p = torch.exp(_block_scores(q, k, diagonal, scale, bias) - lse.to(q.dtype).unsqueeze(-1))
        dp = torch.matmul(dout, v.transpose(-2, -1))
        ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-2, -1), q), torch.matmul(p.transpose(-2, -1), dout)


def _block_forward(q, k, v, diagonal, scale, bias=None):
    """(out, lse) of one block."""
    if _scores_on_cuda(q, bias):
        return ScoresBlocks.forward(q, k, v, diagonal, scale, bias)
    if q.is_cuda:
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, diagonal, scale=scale)
        return o, lse[..., :q.shape[-2]]  # the kernel pads lse's rows to a multiple of 32 (backward pads again)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal, attn_mask=bias,
                                                                        scale=scale)
    if bias is not None:  # a row that sees nothing in this block: the kernel says lse 0, the merge needs -inf
        lse = torch.where(torch.isneginf(bias).all(-1), float("-inf"), lse)
    return o, lse


def _kernel_lse_dtype(t):
    return torch.float64 if t.dtype == torch.float64 and not t.is_cuda else torch.float32


def _block_backward(dout, q, k, v, out, lse, diagonal, scale, bias=None):
    """dQ, dK, dV of one block, given the rows' final output and log-sum-exp."""
    if _scores_on_cuda(q, bias):
        return ScoresBlocks.backward(dout, q, k, v, out, lse, diagonal, scale, bias)
    lse = lse.to(_kernel_lse_dtype(q)).contiguous()
    if q.is_cuda:
        # the kernel reads lse as its forward wrote it: rows padded to a multiple of 32
        rows = q.shape[-2]
        lse = torch.nn.functional.pad(lse, (0, -rows % 32))
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, empty, empty, 0.0, [True, True, True, False], diagonal, scale=scale)
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, diagonal, attn_mask=bias, scale=scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, grid, axis, causal, zigzag, blocks, documents, order):
        ring = grid.ring(axis)
        n, r = ring.size, ring.rank
        B, Z, Lq, A = q.shape
        scale = A ** -0.5
        # The running log-sum-exp is merged in float64 whatever the inputs (B*Z*L/N values;
        # the CUDA merge kernel takes it so): the merge's rounding stays below the output's.
        lse_dtype = torch.float64
        out = torch.zeros_like(q)
        lse = torch.full((B, Z, Lq), float("-inf"), dtype=lse_dtype, device=q.device)
        kc, vc = k, v
        for s in range(n):
            ex = ring.pass_on([kc, vc], s) if s < n - 1 else None  # overlaps the block compute
            for qs, q0, ks, k0, diagonal in _blocks(Lq, n, r, ring.source_at(s), zigzag, causal, order):
                bias = None if documents is None else _document_bias(documents, qs, q0, ks, k0, causal, q.dtype)
                o, l = blocks.forward(q[..., qs, :].contiguous(), kc[..., ks, :].contiguous(),
                                      vc[..., ks, :].contiguous(), diagonal and bias is None, scale, bias)
                o_view, l_view = out[..., qs, :], lse[..., qs]
                lse_merge_(o_view, l_view, o, l.to(lse_dtype))
            if ex is not None:
                kc, vc = ex.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.grid, ctx.axis, ctx.causal, ctx.zigzag, ctx.blocks = grid, axis, causal, zigzag, blocks
        ctx.documents, ctx.order = documents, order
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.grid.ring(ctx.axis)
        n, r = ring.size, ring.rank
        Lq, A = q.shape[2], q.shape[3]
        scale = A ** -0.5
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kc, vc = k, v
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for s in range(n):
            # K and V leave for the next rank at once; their dK, dV accumulators follow
            # once this rank has added its share.
            ex = ring.pass_on([kc, vc], 2 * s) if s < n - 1 else None
            for qs, q0, ks, k0, diagonal in _blocks(Lq, n, r, ring.source_at(s), ctx.zigzag, ctx.causal, ctx.order):
                # rebuilt, not saved from forward: kept, the masks would hold (L/N)^2 per block
                bias = None if ctx.documents is None else \
                    _document_bias(ctx.documents, qs, q0, ks, k0, ctx.causal, q.dtype)
                dqb, dkb, dvb = ctx.blocks.backward(dout[..., qs, :].contiguous(), q[..., qs, :].contiguous(),
                                                kc[..., ks, :].contiguous(), vc[..., ks, :].contiguous(),
                                                out[..., qs, :].contiguous(), lse[..., qs], diagonal and bias is None,
                                                scale, bias)
                dq[..., qs, :] += dqb
                dk[..., ks, :] += dkb
                dv[..., ks, :] += dvb
            back = ring.pass_on([dk, dv], 2 * s + 1)  # the last of these brings them home
            if ex is not None:
                kc, vc = ex.wait()
            dk, dv = back.wait()
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q, k, v, grid, axis="sp", causal=False, zigzag=None, blocks=FusedBlocks, documents=None,
                   order=None):
    """Blockwise ring attention on (batch, heads, L/N, head_dim) shards. zigzag (default:
    when causal) expects the local sequence to be chunks rank and 2N-1-rank. documents: the
    (batch, L) document ids of the whole sequence (packed documents: each block masked to
    its pairs within one document; documents of any length, as ring-flash-attn's varlen).
    order: a ChunkOrder of packed documents (gw.documents.balanced_order): the local sequence
    is this member's chunks of it, and blocks with no visible pair are skipped."""
    zigzag = causal if zigzag is None else zigzag
    n = grid.size(axis)
    if order is None:
        check_sequence(q.shape[2], zigzag)
    elif len(order.members) != n or order.chunk * len(order.members[grid.index(axis)]) != q.shape[2]:
        raise GridError(f"a chunk order of {len(order.members)} members for a ring of {n} holding {q.shape[2]} "
                        "tokens each")
    if documents is not None:
        check_documents(documents, q.shape[0], q.shape[2] * n)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), grid, axis, causal, zigzag, blocks,
                                documents, order)
