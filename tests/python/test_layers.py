"""A whole transformer layer per mode (1-D, 2-D, 3-D) against the dense layer: output,
input gradient and every parameter gradient; Megatron's four all-reduces."""
import pytest
import torch

from tp_refs import DEVICE, full, layer_errors, rel

H, HEADS, B, S = 32, 8, 4, 5


def _layer(ctx, mode, dtype_name, overlap, bias):
    import gridweave as gw

    dtype = getattr(torch, dtype_name)
    n = ctx.world_size
    tp = {"1d": gw.Row(n), "2d": gw.Square(2), "3d": gw.Cube(2)}[mode]
    grid = ctx.init(tp=tp)
    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(H, HEADS, bias=bias, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    kw = {"overlap": overlap} if mode == "3d" else {}
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode, **kw)
    x = full((B, S, H), 11, dtype).requires_grad_()
    y = dense(x)
    dy = full(y.shape, 12, dtype)
    y.backward(dy)
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    grid.reset_stats()
    yl = layer(xl)
    yl.backward(gw.scatter(dy, layer.output_layout, grid))
    stats = grid.stats()
    errs = layer_errors(layer, dense, grid, x, xl, y, yl)
    # the planner's schedule, recorded on meta tensors, is the collectives this run issued
    from collections import Counter

    from gridweave.recorder import collectives_at

    planned = Counter(c.axis for c in collectives_at(layer.mode, H, HEADS, S, 1, B))
    ran = {axis: c["ops"] for axis, c in stats.items()}
    return errs, stats, dict(planned), ran


CASES = [("1d", 2), ("1d", 4), ("1d", 8), ("2d", 4), ("3d", 8)]


@pytest.mark.parametrize("mode,n", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_transformer_layer_matches_dense(pool, mode, n, dtype):
    limit = 1e-10 if dtype == "float64" else 1e-5
    for errs, _, planned, ran in pool.run(_layer, n, mode, dtype, False, True):
        assert max(errs.values()) < limit, {k: v for k, v in errs.items() if v >= limit}
        assert planned == ran, (planned, ran)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_3d_layer_overlap_and_bias(pool, overlap, bias):
    for errs, _, _, _ in pool.run(_layer, 8, "3d", "float64", overlap, bias):
        assert max(errs.values()) < 1e-10, errs


def test_1d_layer_moves_exactly_four_all_reduces(pool):
    n = 4
    for errs, stats, _, _ in pool.run(_layer, n, "1d", "float64", False, True):
        assert list(stats) == ["tp"]
        tp = stats["tp"]
        assert tp["ops"] == 4  # g after attention and MLP forward, f before them backward
        sent = tp["sent_intra"]["bytes"] + tp["sent_inter"]["bytes"]
        assert sent == 4 * 2 * (n - 1) * (B * S * H * 8) // n  # ring all-reduce of b*s*h each


def _blocks(ctx, mode):
    import gridweave as gw

    n = ctx.world_size
    grid = ctx.init(tp={"1d": gw.Row(n), "2d": gw.Square(2), "3d": gw.Cube(2)}[mode])
    torch.manual_seed(1)
    errs = {}
    for name, dense in (("attn", gw.nn.DenseSelfAttention(H, HEADS, dtype=torch.float64, device=DEVICE)),
                        ("mlp", gw.nn.DenseMLP(H, 2 * H, dtype=torch.float64, device=DEVICE))):
        cls = gw.nn.SelfAttention if name == "attn" else gw.nn.MLP
        block = cls.from_dense(dense, grid, mode=mode)
        assert block.input_layout == block.output_layout
        x = full((B, S, H), 13).requires_grad_()
        y = dense(x)
        dy = full(y.shape, 14)
        y.backward(dy)
        xl = gw.scatter(x.detach(), block.input_layout, grid).requires_grad_()
        yl = block(xl)
        yl.backward(gw.scatter(dy, block.output_layout, grid))
        errs[name + ".y"] = rel(gw.gather(yl, block.output_layout, grid), y)
        errs[name + ".dx"] = rel(gw.gather(xl.grad, block.input_layout, grid), x.grad)
        g = block.dense_state(grad=True)
        for k, p in dense.named_parameters():
            errs[f"{name}.{k}"] = rel(g[k], p.grad)
        back = block.to_dense().state_dict()
        errs[name + ".to_dense"] = max(rel(back[k], v) for k, v in dense.state_dict().items())
    return errs


@pytest.mark.parametrize("mode,n", [("1d", 4), ("2d", 4), ("3d", 8)])
def test_attention_and_mlp_blocks_match_dense(pool, mode, n):
    for errs in pool.run(_blocks, n, mode):
        assert max(errs.values()) < 1e-10, errs



def _latent_arch(q_rank, v=10):
    import gridweave as gw

    mla = gw.nn.MLA(kv_rank=12, q_rank=q_rank, nope=6, rope=4, v=v)
    return gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, rope_theta=500.0, eps=1e-6, mla=mla)


def _latent_layer(ctx, shape, dtype_name, q_rank, packed=False, v=10, attention="ring", ulysses_degree=1):
    """DeepSeek's latent-attention layer (gw.nn.LatentAttention) with a dense SwiGLU MLP on a grid
    against the dense layer: output, input gradient, every parameter gradient, to_dense; packed:
    with packed documents (attention within each, rotary positions restarting). With sp: the
    sequence of 8 tokens split over it, attention as given; tp_sp: Megatron's sequence
    parallelism on the tp mode."""
    import dataclasses

    import gridweave as gw

    dtype = getattr(torch, dtype_name)
    shape = dict(shape)
    tp_sp = shape.pop("tp_sp", False)
    axes = {k: gw.modes.parse(v) if k == "tp" else v for k, v in shape.items()}
    if tp_sp:
        axes["tp"] = dataclasses.replace(axes["tp"], sequence=True)
    grid = ctx.init(**axes)
    torch.manual_seed(0)
    arch = _latent_arch(q_rank, v)
    dense = gw.nn.DenseTransformerLayer(H, HEADS, 24, bias=False, dtype=dtype, device=DEVICE, arch=arch)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    kw = dict(attention=attention, ulysses_degree=ulysses_degree) if "sp" in shape else {}
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, **kw)
    seq = 8 if "sp" in shape or tp_sp else S
    x = full((B, seq, H), 11, dtype).requires_grad_()
    docs = None
    if packed and seq == S:
        docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], device=DEVICE)
    elif packed and seq == 8:
        docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2], [0] * 8, [0, 0, 0, 0, 0, 1, 1, 1]],
                            device=DEVICE)
    y = dense(x, docs)
    dy = full(y.shape, 12, dtype)
    y.backward(dy)
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    grid.reset_stats()
    dp, i = grid.axes.get("dp", 1), grid.index("dp") if "dp" in grid.axes else 0
    yl = layer(xl, None if docs is None else docs[i * B // dp:(i + 1) * B // dp])  # this replica's rows
    yl.backward(gw.scatter(dy, layer.output_layout, grid))
    tp_ops = grid.stats().get("tp", {}).get("ops", 0)
    gw.reduce_gradients(layer, grid)
    return layer_errors(layer, dense, grid, x, xl, y, yl), tp_ops


def _tp_ops(shape) -> int:
    """The layer's collectives over tp. Megatron's f / g: g after the attention and the MLP forward,
    f on the q (or its latent) and kv latents, the shared rotary key and the MLP's input backward:
    six all-reduces. With Megatron-SP (Korthikanti et al. §4.2.2) each of the three gathering
    linears (q or its up projection, kv's up projection, the MLP's first) all-gathers forward and
    again backward and reduce-scatters its input's gradient, each of the two reduce-scattering
    ones all-gathers its gradient, and the rotary key is all-gathered and reduce-scattered back:
    3 x 3 + 2 x 2 + 2 = 15."""
    if "tp" not in shape:
        return 0
    return 15 if shape.get("tp_sp") else 6


@pytest.mark.parametrize("shape,n,q_rank", [(dict(tp="row:2"), 2, 8), (dict(tp="row:4"), 4, None),
                                            (dict(tp="row:2", dp=2), 4, 8), (dict(dp=4), 4, 8),
                                            (dict(tp="row:2", tp_sp=True), 2, None),
                                            (dict(tp="row:4", tp_sp=True), 4, 8),
                                            (dict(tp="row:2", tp_sp=True, dp=2), 4, 8)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_latent_attention_layer_matches_dense(pool, shape, n, q_rank, dtype):
    """Megatron-Core's split of DeepSeek's latent attention: the heads over tp (up projections by
    rows, the output projection by columns), the down projections and latent norms replicated; on
    tp alone, tp x dp and dp alone; with Megatron's sequence parallelism the down projections and
    norms on each rank's piece of the sequence, the up projections gathering the latents."""
    limit = 1e-10 if dtype == "float64" else 1e-5
    for errs, tp_ops in pool.run(_latent_layer, n, shape, dtype, q_rank):
        assert max(errs.values()) < limit, {k: v for k, v in errs.items() if v >= limit}
        assert tp_ops == _tp_ops(shape), tp_ops


@pytest.mark.parametrize("shape", [dict(tp="row:2", dp=2), dict(tp="row:2", tp_sp=True, dp=2)])
def test_latent_attention_masks_packed_documents_like_the_dense_layer(pool, shape):
    for errs, _ in pool.run(_latent_layer, 4, shape, "float64", 8, True):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


# values narrower than the queries (the ring pads them: DeepSeek-V3's 128 against 192), wider
# (Ulysses' all-to-all takes them as they are), equal; the sequence split over sp with tp and dp
@pytest.mark.parametrize("shape,n,q_rank,v,attention,u", [
    (dict(sp=2), 2, 8, 6, "ring", 1), (dict(tp="row:2", sp=2), 4, None, 12, "ulysses", 1),
    (dict(sp=4), 4, 8, 6, "usp", 2), (dict(dp=2, sp=2, tp="row:2"), 8, 8, 10, "ring", 1),
    (dict(tp="row:2", tp_sp=True, sp=2), 4, 8, 6, "ring", 1), (dict(tp="row:2", tp_sp=True, sp=2), 4, None, 12,
                                                               "ulysses", 1)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_latent_attention_over_sequence_parallelism_matches_dense(pool, shape, n, q_rank, v, attention, u, dtype):
    """Every projection the token's own on its sp shard, the rotary parts at the global positions,
    the heads meeting over sp (the zigzag ring, Ulysses, USP): the dense layer's output and every
    gradient; over tp still six all-reduces."""
    limit = 1e-10 if dtype == "float64" else 1e-5
    for errs, tp_ops in pool.run(_latent_layer, n, shape, dtype, q_rank, False, v, attention, u):
        assert max(errs.values()) < limit, {k: e for k, e in errs.items() if e >= limit}
        assert tp_ops == _tp_ops(shape), tp_ops


@pytest.mark.parametrize("attention,u,tp_sp", [("ring", 1, False), ("ulysses", 1, False), ("usp", 2, False),
                                               ("ring", 1, True)])
def test_latent_attention_over_sp_masks_packed_documents_like_the_dense_layer(pool, attention, u, tp_sp):
    shape = dict(sp=4) if attention == "usp" else dict(tp="row:2", sp=2, tp_sp=tp_sp)
    for errs, _ in pool.run(_latent_layer, 4, shape, "float64", 8, True, 6 if attention != "ulysses" else 12,
                            attention, u):
        assert max(errs.values()) < 1e-10, {k: e for k, e in errs.items() if e >= 1e-10}


def _latent_refused(ctx, shape, tp_sp=False, attention="ring", v=10):
    import dataclasses

    import gridweave as gw

    shape = dict(shape)
    if "tp" in shape:
        shape["tp"] = gw.modes.parse(shape["tp"])
        if tp_sp:
            shape["tp"] = dataclasses.replace(shape["tp"], sequence=True)
    grid = ctx.init(**shape)
    try:
        gw.nn.TransformerLayer(H, HEADS, grid, ffn_hidden=24, bias=False, arch=_latent_arch(None, v),
                               attention=attention)
    except gw.GridError as e:
        return str(e)
    return "built"


def test_latent_attention_refuses_the_modes_that_split_its_sequence_or_hidden(pool):
    assert pool.run(_latent_refused, 2, dict(tp="row:2"), True) == ["built", "built"]  # tp_sp
    assert "each token's hidden vector whole (tp none or row:N)" in \
        pool.run(_latent_refused, 4, dict(tp="square:2"))[0]
    assert "ring, ulysses or usp, not rsa" in pool.run(_latent_refused, 2, dict(sp=2), False, "rsa")[0]
    assert "v_dim 12 is wider than qk_nope_dim + qk_rope_dim = 10" in \
        pool.run(_latent_refused, 2, dict(sp=2), False, "ring", 12)[0]
    assert pool.run(_latent_refused, 2, dict(sp=2), False, "ulysses", 12) == ["built", "built"]
