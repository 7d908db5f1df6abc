"""Sub-graph parallelism (SUPER): D&SP and cSub layers vs dense, 10 training steps vs
dense and pure data parallelism, and the topology counters vs SUPER eqs. (4)-(7)."""
import pytest
import torch

from refs import grid_errors
from tp_refs import DEVICE, full, rel

H, HEADS, B, S = 16, 4, 8, 4


def _attention(ctx, g, mode, projection, method):
    import gridweave as gw

    grid = ctx.init(dp=ctx.world_size // g, tp=gw.SubGraph(g))
    torch.manual_seed(0)
    dense = gw.nn.DenseSelfAttention(H, HEADS, dtype=torch.float64, device=DEVICE)
    attn = gw.nn.SubGraphAttention.from_dense(dense, grid, mode=mode, projection=projection, method=method)
    x = full((B, S, H), 1).requires_grad_()
    y = dense(x)
    dy = full(y.shape, 2)
    y.backward(dy)
    lay = attn.input_layout
    xl = gw.scatter(x.detach(), lay, grid).requires_grad_()
    yl = attn(xl)
    yl.backward(gw.scatter(dy, lay, grid))
    gw.reduce_gradients(attn, grid)
    errs = {"y": rel(gw.gather(yl, lay, grid, shape=y.shape), y),
            "dx": rel(gw.gather(xl.grad, lay, grid, shape=x.shape), x.grad)}
    grads = attn.dense_state(grad=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    errs["to_dense"] = rel(attn.to_dense().qkv.weight, dense.qkv.weight)
    return errs


@pytest.mark.parametrize("g,n", [(2, 4), (4, 8), (2, 8)])
@pytest.mark.parametrize("mode", ["dsp", "csub"])
@pytest.mark.parametrize("projection,method", [("branch", "all_gather"), ("common", "all_gather"),
                                               ("common", "all_to_all")])
def test_subgraph_attention_matches_dense(pool, g, n, mode, projection, method):
    for errs in pool.run(_attention, n, g, mode, projection, method):
        assert max(errs.values()) < 1e-10, errs


def _train(ctx, kind, g, steps=10):
    import gridweave as gw

    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(H, HEADS, dtype=torch.float64, device=DEVICE)
    x_full = full((B, S, H), 3)
    if kind == "dense":
        layer, grid = dense, None
    elif kind == "dp":
        grid = ctx.init(dp=ctx.world_size)
        layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode="sp")
    else:
        grid = ctx.init(dp=ctx.world_size // g, tp=gw.SubGraph(g))
        layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=kind)
    x = x_full if grid is None else gw.scatter(x_full, layer.input_layout, grid)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        y = layer(x)
        if grid is None:
            loss = y.pow(2).sum(-1).mean()
            total = loss.item()
        else:
            loss = gw.nn.global_token_mean(y.pow(2).sum(), y.shape[0] * y.shape[1], grid, ("dp", "sg"))
            t = loss.detach().reshape(1).clone()
            grid.all_reduce(t, axis=tuple(a for a in ("dp", "sg") if a in grid.axes))
            total = t.item()
        loss.backward()
        if grid is not None:
            gw.reduce_gradients(layer, grid)
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("g,n", [(2, 4), (4, 8)])
def test_ten_steps_equal_dense_and_data_parallel(pool, g, n):
    ref = pool.run(_train, 1, "dense", 1)[0]
    assert ref[-1] < ref[0]  # it trains
    for kind in ("dp", "dsp", "csub"):
        for losses in pool.run(_train, n, kind, g):
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-10, (kind, losses, ref)


def _a2a_counts(ctx, g, placement, rpn):
    import gridweave as gw

    grid = ctx.init(dp=ctx.world_size // g, tp=gw.SubGraph(g), placement=placement, ranks_per_node=rpn)
    x = torch.zeros(4 * g, 8, dtype=torch.float64, device=DEVICE)  # this rank's common shard
    grid.reset_stats()
    from gridweave.modes.subgraph import slice_

    slice_(x, grid, "dsp", "all_to_all")  # SUPER's segmented all-to-all at a slice
    s = grid.stats()["sg"]
    return s["sent_intra"]["messages"], s["sent_inter"]["messages"], s["sent_inter"]["bytes"]


@pytest.mark.parametrize("g", [2, 4])
def test_topology_counters_equal_super_equations(pool, g):
    n, n_node = 8, 2  # 4 emulated nodes of 2 ranks
    n_g = n // g
    for placement in ("naive", "topology"):
        res = pool.run(_a2a_counts, n, g, placement, n_node)
        intra = sum(r[0] for r in res)
        inter = sum(r[1] for r in res)
        if placement == "topology":  # eqs. (6), (7)
            e_intra = n * g if g <= n_node else n * n_node
            e_inter = 0 if g <= n_node else n * (g - n_node)
        else:  # eqs. (4), (5), with the case conditions as counted (see tests/cpp/test_placement.cpp)
            e_intra = n if n_g >= n_node else n_node * g
            e_inter = n * (g - 1) if n_g >= n_node else (n - n_node) * g
        # SUPER counts each process's message to itself (n of them); the engine sends none.
        assert intra + n == e_intra, (placement, intra, e_intra)
        assert inter == e_inter, (placement, inter, e_inter)
        per_msg = (4 * g) * 8 * 8 // g  # the shard's bytes / g per message
        assert sum(r[2] for r in res) == e_inter * per_msg


def _bad(ctx):
    import gridweave as gw

    grid = ctx.init(dp=2, tp=gw.SubGraph(2))
    return grid_errors((lambda: gw.nn.SubGraphAttention(16, 3, grid),
                               lambda: gw.scatter(torch.zeros(6, 2, 16, device=DEVICE), gw.nn.subgraph.subgraph_layout("dsp"), grid)))


def test_heads_or_batch_that_g_does_not_divide_fail_clearly(pool):
    for msgs in pool.run(_bad, 4):
        assert all(msgs), msgs
        assert "3 heads" in msgs[0] and "does not split" in msgs[1]
