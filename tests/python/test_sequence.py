"""Sequence parallelism (Li et al.): RSA and blockwise ring attention against dense
softmax attention, bytes against the paper, error growth with N."""
import pytest
import torch

from refs import grid_errors
from tp_refs import DEVICE, full, packed_documents, rel

B, Z, A = 2, 2, 4


def _layout(causal_zigzag):
    import gridweave as gw

    return gw.Layout((), (), ("sp",), zigzag=2 if causal_zigzag else None)


def _attention(ctx, algo, causal, L, dtype_name, blocks="FusedBlocks"):
    import gridweave as gw
    from gridweave.autograd import ring
    from gridweave.autograd.ring import ring_attention, ring_self_attention

    dtype = getattr(torch, dtype_name)
    grid = ctx.init(sp=ctx.world_size)
    q, k, v = (full((B, Z, L, A), s).requires_grad_() for s in (1, 2, 3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    dout = full(ref.shape, 4)
    ref.backward(dout)
    zig = algo == "ring" and causal
    lay = _layout(zig)
    ql, kl, vl = (gw.scatter(t.detach(), lay, grid).to(dtype).requires_grad_() for t in (q, k, v))
    grid.reset_stats()
    if algo == "rsa":
        out = ring_self_attention(ql, kl, vl, grid, causal=causal)
    else:
        out = ring_attention(ql, kl, vl, grid, causal=causal, blocks=getattr(ring, blocks))
    fwd = grid.stats().get("sp", None)
    grid.reset_stats()
    out.backward(gw.scatter(dout, lay, grid).to(dtype))
    bwd = grid.stats().get("sp", None)

    def sent(s):
        return 0 if s is None else s["sent_intra"]["bytes"] + s["sent_inter"]["bytes"]

    errs = {"out": rel(gw.gather(out, lay, grid), ref)}
    for name, loc, ref_t in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errs[name] = rel(gw.gather(loc.grad, lay, grid), ref_t.grad)
    # torch's own error in this dtype, for the flash-attention tolerance rule
    q32, k32, v32 = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o32 = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    o32.backward(dout.to(dtype))
    errs["torch"] = max(rel(o32, ref), rel(q32.grad, q.grad), rel(k32.grad, k.grad), rel(v32.grad, v.grad))
    return errs, sent(fwd), sent(bwd)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("algo", ["rsa", "ring"])
def test_ring_attention_matches_dense(pool, n, causal, algo):
    L = 32
    for errs, fwd, bwd in pool.run(_attention, n, algo, causal, L, "float64"):
        assert max(v for k, v in errs.items() if k != "torch") < 1e-10, errs
        if algo == "rsa":
            b = B * Z * (L // n) * A * 8
            assert fwd == 2 * (n - 1) * b  # Li et al. §3.3: 2(N-1)BZ(L/N)A forward
            assert bwd == 6 * (n - 1) * b  # and 6(N-1)BZ(L/N)A backward


def _ulysses(ctx, causal, L, heads, kv=None):
    import gridweave as gw
    from gridweave.autograd.ulysses import ulysses_attention

    grid = ctx.init(sp=ctx.world_size)
    kv = kv or heads
    q, k, v = (full((B, h, L, A), s).requires_grad_() for s, h in ((1, heads), (2, kv), (3, kv)))
    # one process: every key/value head repeated to its group of query heads (autograd sums the copies)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, *(t.repeat_interleave(heads // kv, dim=1) for t in (k, v)), is_causal=causal)
    dout = full(ref.shape, 4)
    ref.backward(dout)
    lay = _layout(False)  # contiguous shards: Ulysses gathers whole sequences in order
    ql, kl, vl = (gw.scatter(t.detach(), lay, grid).requires_grad_() for t in (q, k, v))
    grid.reset_stats()
    out = ulysses_attention(ql, kl, vl, grid, causal=causal)
    fwd = grid.stats().get("sp")
    grid.reset_stats()
    out.backward(gw.scatter(dout, lay, grid))
    bwd = grid.stats().get("sp")
    errs = {"out": rel(gw.gather(out, lay, grid), ref)}
    for name, loc, ref_t in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errs[name] = rel(gw.gather(loc.grad, lay, grid), ref_t.grad)
    sent = [0 if s is None else s["sent_intra"]["bytes"] + s["sent_inter"]["bytes"] for s in (fwd, bwd)]
    ops = [0 if s is None else s["ops"] for s in (fwd, bwd)]
    return errs, sent, ops


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_matches_dense(pool, n, causal):
    """DeepSpeed-Ulysses: 4 all-to-alls a direction, each rank sending (N-1)/N of its B·(L/N)·H
    values each time (Jacobs et al. 2023 §3.1)."""
    L, heads = 32, 8
    for errs, sent, ops in pool.run(_ulysses, n, causal, L, heads):
        assert max(errs.values()) < 1e-10, errs
        shard = B * heads * (L // n) * A * 8  # bytes of one of q, k, v, out on a rank
        if n > 1:
            assert ops == [4, 4], ops
            assert sent == [4 * shard * (n - 1) // n] * 2, (sent, shard)


@pytest.mark.parametrize("n,heads,kv", [(2, 8, 2), (4, 8, 2), (4, 8, 4), (8, 8, 2), (4, 8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_sends_grouped_key_value_heads_as_they_are(pool, n, heads, kv, causal):
    """Grouped-query attention under Ulysses: key/value heads cross the all-to-all as they are where
    the n ranks divide them, else each repeated to lcm(kv, n) (whole groups on every rank). The
    bytes a rank sends per direction are (N-1)/N of B·(L/N)·A·(2 heads + 2 lcm(kv, n)) values
    (q, out; k, v), against 4 heads once expanded; results and gradients equal one process."""
    import math

    L = 32
    sent_heads = math.lcm(kv, n)
    for errs, sent, ops in pool.run(_ulysses, n, causal, L, heads, kv):
        assert max(errs.values()) < 1e-10, errs
        values = B * (L // n) * A * (2 * heads + 2 * sent_heads)
        assert ops == [4, 4] and sent == [values * 8 * (n - 1) // n] * 2, (sent, values)
        if sent_heads < heads:
            assert sent[0] < 4 * B * (L // n) * A * heads * 8 * (n - 1) // n  # fewer bytes than expanded


def _usp(ctx, causal, L, heads, u, kv=None):
    import gridweave as gw
    from gridweave.autograd.ulysses import usp_attention
    from gridweave.nn.sequence import usp_positions

    grid = ctx.init(sp=ctx.world_size)
    n = ctx.world_size
    kv = kv or heads
    q, k, v = (full((B, h, L, A), s).requires_grad_() for s, h in ((1, heads), (2, kv), (3, kv)))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, *(t.repeat_interleave(heads // kv, dim=1) for t in (k, v)), is_causal=causal)
    dout = full(ref.shape, 4)
    ref.backward(dout)
    # this rank's piece: the sequence in zigzag order over the n/u blocks (causal), cut in n pieces
    pos = usp_positions(L // n, n, grid.index("sp"), n // u, causal, DEVICE)
    ql, kl, vl = (t.detach()[:, :, pos].contiguous().requires_grad_() for t in (q, k, v))
    inner, outer = gw.LinePart(("sp",), gw.Span.WITHIN, u), gw.LinePart(("sp",), gw.Span.ACROSS, u)
    grid.reset_stats()
    out = usp_attention(ql, kl, vl, grid, inner, outer, causal)
    out.backward(dout[:, :, pos].contiguous())
    errs = {"out": rel(out, ref[:, :, pos])}
    for name, loc, ref_t in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errs[name] = rel(loc.grad, ref_t.grad[:, :, pos])
    return errs, sorted(k for k, v in grid.stats().items() if v["ops"])


@pytest.mark.parametrize("n,u", [(4, 2), (8, 2), (8, 4), (4, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_usp_attention_matches_dense(pool, n, u, causal):
    """USP: Ulysses inside blocks of u sp ranks, the (zigzag) ring across the n/u blocks; u = 1 is
    the ring alone, u = n Ulysses alone."""
    for errs, axes in pool.run(_usp, n, causal, 32, 8, u):
        assert max(errs.values()) < 1e-10, errs
        assert (f"sp:within{u}" in axes) == (u > 1) and (f"sp:across{u}" in axes) == (u < n), axes


@pytest.mark.parametrize("n,u,kv", [(4, 2, 2), (8, 4, 2), (8, 2, 1)])
def test_usp_under_grouped_query_attention_equals_one_process(pool, n, u, kv):
    """USP's all-to-all sends grouped key/value heads as Ulysses does; the ring across its blocks
    repeats them to the query heads."""
    for errs, _ in pool.run(_usp, n, True, 32, 8, u, kv):
        assert max(errs.values()) < 1e-10, errs


def _ulysses_heads(ctx):
    from gridweave.autograd.ulysses import ulysses_attention

    grid = ctx.init(sp=ctx.world_size)
    q = torch.zeros(B, 6, 4, A, device=DEVICE)
    return grid_errors((lambda: ulysses_attention(q, q, q, grid),))


def test_ulysses_heads_that_do_not_split_fail_clearly(pool):
    for msgs in pool.run(_ulysses_heads, 4):
        assert msgs[0] and "do not divide" in msgs[0], msgs


def test_ulysses_in_the_main_job_checks_its_heads_before_anything_runs():
    import gridweave as gw

    with pytest.raises(gw.GridError, match="attention=ulysses splits each tensor group's 2 heads over 4"):
        gw.train.TrainConfig(heads=4, hidden=32, tp="row:2", attention="ulysses", sp=4, dp=1, pp=1).grid_shape(8)
    with pytest.raises(gw.GridError, match="attention must be one of"):
        gw.train.TrainConfig(attention="flash")
    with pytest.raises(gw.GridError, match="attention=usp needs ulysses_degree dividing sp 4"):
        gw.train.TrainConfig(heads=4, hidden=32, attention="usp", ulysses_degree=3, sp=4, dp=1, pp=1).grid_shape(4)
    with pytest.raises(gw.GridError, match="ulysses_degree is USP's"):
        gw.train.TrainConfig(heads=4, hidden=32, ulysses_degree=2, sp=4, dp=1, pp=1).grid_shape(4)
    with pytest.raises(gw.GridError, match="SUPER's branches run the ring"):
        gw.train.TrainConfig(heads=4, hidden=32, tp="subgraph:2", attention="ulysses", sp=2, dp=1, pp=1).grid_shape(4)


def test_backward_error_does_not_grow_with_n(pool):
    worst = {}
    for n in (2, 8):
        res = pool.run(_attention, n, "ring", True, 64, "float32")
        worst[n] = max(max(e["dq"], e["dk"], e["dv"]) for e, _, _ in res)
        torch_err = max(e["torch"] for e, _, _ in res)
        assert worst[n] <= 2 * torch_err + 1e-7, (n, worst[n], torch_err)  # flash-attention's rule
    assert worst[8] <= 2 * worst[2] + 1e-7, worst


def _agree(ctx):
    import gridweave as gw
    from gridweave.autograd.ring import ring_attention, ring_self_attention

    grid = ctx.init(sp=ctx.world_size)
    lay = _layout(False)
    q, k, v = (gw.scatter(full((B, Z, 16, A), s), lay, grid) for s in (5, 6, 7))
    a = ring_self_attention(q, k, v, grid, causal=True)
    b = ring_attention(q, k, v, grid, causal=True, zigzag=False)
    return rel(a, b)


def test_rsa_and_ring_attention_agree(pool):
    assert max(pool.run(_agree, 4)) < 1e-12


def _indivisible(ctx):
    import gridweave as gw
    from gridweave.autograd.ring import ring_attention

    grid = ctx.init(sp=ctx.world_size)
    return grid_errors((lambda: gw.scatter(torch.zeros(B, Z, 6, A, device=DEVICE), _layout(False), grid),
                               lambda: gw.scatter(torch.zeros(B, Z, 12, A, device=DEVICE), _layout(True), grid),
                               lambda: ring_attention(*(torch.zeros(B, Z, 3, A, device=DEVICE) for _ in range(3)), grid, causal=True)))


def test_sequence_lengths_that_do_not_split_fail_clearly(pool):
    for msgs in pool.run(_indivisible, 4):
        assert all(msgs), msgs
        assert "does not split over" in msgs[0] and "zigzag" in msgs[1] and "even local sequence" in msgs[2]


def _sp_layer(ctx, dp, attention, causal, ulysses_degree=1):
    import gridweave as gw

    sp = ctx.world_size // dp
    grid = ctx.init(dp=dp, sp=sp)
    torch.manual_seed(0)
    H, heads, Bt, L = 16, 4, 4, 16
    dense = gw.nn.DenseTransformerLayer(H, heads, causal=causal, dtype=torch.float64, device=DEVICE)
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode="sp", attention=attention,
                                              ulysses_degree=ulysses_degree)
    x = full((Bt, L, H), 21).requires_grad_()
    y = dense(x)
    loss = y.pow(2).sum(-1).mean()  # mean over every token of the global batch
    loss.backward()
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    yl = layer(xl)
    tokens = yl.shape[0] * yl.shape[1]
    local = gw.nn.global_token_mean(yl.pow(2).sum(), tokens, grid)
    local.backward()
    gw.reduce_gradients(layer, grid)
    total = local.detach().clone().reshape(1)
    grid.all_reduce(total, axis=("dp", "sp"))
    errs = {"loss": rel(total[0], loss), "dx": rel(gw.gather(xl.grad, layer.input_layout, grid), x.grad)}
    grads = layer.dense_state(grad=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    return errs


@pytest.mark.parametrize("dp,n", [(1, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("attention,causal", [("ring", True), ("ring", False), ("rsa", True), ("ulysses", True),
                                              ("ulysses", False)])
def test_sequence_parallel_layer_with_dp_matches_dense(pool, dp, n, attention, causal):
    for errs in pool.run(_sp_layer, n, dp, attention, causal):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


@pytest.mark.parametrize("dp,n", [(1, 4), (2, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_usp_layer_with_dp_matches_dense(pool, dp, n, causal):
    """The layer's input in USP's layout (zigzag over the 2 blocks of 2 sp ranks when causal)."""
    for errs in pool.run(_sp_layer, n, dp, "usp", causal, 2):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


def _blocks(ctx):
    import gridweave as gw

    grid = ctx.init(sp=ctx.world_size)
    torch.manual_seed(2)
    out = {}
    for cls, causal in ((gw.nn.RingSelfAttention, False), (gw.nn.RingAttention, True)):
        dense = gw.nn.DenseSelfAttention(16, 4, causal=causal, dtype=torch.float64, device=DEVICE)
        block = cls.from_dense(dense, grid)
        x = full((2, 16, 16), 22)
        out[cls.__name__] = rel(gw.gather(block(gw.scatter(x, block.input_layout, grid)), block.output_layout, grid),
                                dense(x))
        out[cls.__name__ + ".to_dense"] = rel(block.to_dense().qkv.weight, dense.qkv.weight)
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_on_materialised_scores_matches_dense(pool, n, causal):
    # ScoresBlocks: float64 on CUDA, where torch's fused kernels refuse it
    for errs, _, _ in pool.run(_attention, n, "ring", causal, 32, "float64", "ScoresBlocks"):
        assert max(v for k, v in errs.items() if k != "torch") < 1e-10, errs


def test_ring_attention_blocks_match_dense(pool):
    for errs in pool.run(_blocks, 4):
        assert max(errs.values()) < 1e-10, errs


# ---- packed documents (issue 31): attention within each document, on every sp algorithm --------

def _per_document(q, k, v, documents, causal):
    """Each document's attention alone (torch's SDPA on its slice): the independent reference."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in documents[b].unique():
            idx = (documents[b] == d).nonzero().flatten()
            sl = slice(int(idx[0]), int(idx[-1]) + 1)
            out[b:b + 1, :, sl] = torch.nn.functional.scaled_dot_product_attention(
                q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl], is_causal=causal)
    return out


def _document_attention(ctx, algo, causal, u=1):
    import gridweave as gw
    from gridweave.autograd.ring import ring_attention, ring_self_attention
    from gridweave.autograd.ulysses import ulysses_attention, usp_attention

    n, L, heads = ctx.world_size, 48, 4
    grid = ctx.init(sp=n)
    docs = packed_documents(B, L, 7)
    q, k, v = (full((B, heads, L, A), s).requires_grad_() for s in (1, 2, 3))
    ref = _per_document(q, k, v, docs, causal)
    dout = full(ref.shape, 4)
    ref.backward(dout)
    if algo == "usp":
        lay = gw.Layout((), (), ("sp",), zigzag=2 if causal else None, ring=n // u if causal else None)
    else:
        lay = _layout(algo == "ring" and causal)
    ql, kl, vl = (gw.scatter(t.detach(), lay, grid).requires_grad_() for t in (q, k, v))
    if algo == "rsa":
        out = ring_self_attention(ql, kl, vl, grid, causal=causal, documents=docs)
    elif algo == "ring":
        out = ring_attention(ql, kl, vl, grid, causal=causal, documents=docs)
    elif algo == "ulysses":
        out = ulysses_attention(ql, kl, vl, grid, causal=causal, documents=docs)
    else:
        out = usp_attention(ql, kl, vl, grid, gw.LinePart(("sp",), gw.Span.WITHIN, u),
                            gw.LinePart(("sp",), gw.Span.ACROSS, u), causal, documents=docs)
    out.backward(gw.scatter(dout, lay, grid))
    errs = {"out": rel(gw.gather(out, lay, grid), ref)}
    for name, loc, ref_t in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errs[name] = rel(gw.gather(loc.grad, lay, grid), ref_t.grad)
    # and the dense path with the same mask
    dense = gw.nn.dense.attention(torch.cat([t.detach().transpose(1, 2).reshape(B, L, -1) for t in (q, k, v)], -1),
                                  heads, causal, documents=docs)
    errs["dense"] = rel(dense, ref.detach().transpose(1, 2).reshape(B, L, -1))
    return errs


@pytest.mark.parametrize("algo,n,u", [("ring", 2, 1), ("ring", 4, 1), ("rsa", 4, 1), ("ulysses", 2, 1),
                                      ("ulysses", 4, 1), ("usp", 4, 2), ("usp", 8, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_attend_within_each_document(pool, algo, n, u, causal):
    """Packed documents of varied lengths: every sp algorithm (the zigzag ring's blocks masked per
    document pair, RSA's score rows, Ulysses' and USP's) equals each document's attention run
    alone, forward and backward (float64 1e-10)."""
    for errs in pool.run(_document_attention, n, algo, causal, u):
        assert max(errs.values()) < 1e-10, errs
