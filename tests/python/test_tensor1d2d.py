"""1-D (Megatron) on 2, 4, 8 ranks and 2-D (SUMMA) on 2x2 against dense torch."""
import pytest
import torch

from refs import grid_errors
from tp_refs import DEVICE, full, rel


def _one_d(ctx, dtype_name):
    import gridweave as gw

    dtype = getattr(torch, dtype_name)
    n = ctx.world_size
    grid = ctx.init(tp=gw.Row(n))
    torch.manual_seed(0)  # every rank builds the same dense modules
    errs = {}
    col_d = torch.nn.Linear(12, 8 * n // 2 * 2, dtype=dtype, device=DEVICE)
    row_d = torch.nn.Linear(col_d.out_features, 6, dtype=dtype, device=DEVICE)
    col = gw.nn.ColumnParallelLinear.from_dense(col_d, grid)
    row = gw.nn.RowParallelLinear.from_dense(row_d, grid)
    x = full((2, 4, 12), 1, dtype).requires_grad_()
    y = row_d(torch.tanh(col_d(x)))
    dy = full(y.shape, 2, dtype)
    y.backward(dy)
    xl = x.detach().clone().requires_grad_()
    yl = row(torch.tanh(col(xl)))
    yl.backward(dy)
    errs["y"] = rel(yl, y)
    errs["dx"] = rel(xl.grad, x.grad)
    for name, m, d in (("col", col, col_d), ("row", row, row_d)):
        g = m.dense_state(grad=True)
        errs[name + ".dW"] = rel(g["weight"], d.weight.grad)
        errs[name + ".db"] = rel(g["bias"], d.bias.grad)
        errs[name + ".to_dense"] = rel(m.to_dense().weight, d.weight)
    # gather_output / input_is_parallel=False variants
    col2 = gw.nn.ColumnParallelLinear.from_dense(col_d, grid, gather_output=True)
    row2 = gw.nn.RowParallelLinear.from_dense(row_d, grid, input_is_parallel=False)
    errs["gathered"] = rel(row2(col2(x.detach())), row_d(col_d(x.detach())))

    emb_d = torch.nn.Embedding(4 * n, 7, dtype=dtype, device=DEVICE)
    emb = gw.nn.VocabParallelEmbedding.from_dense(emb_d, grid)
    ids = torch.randint(0, 4 * n, (2, 4), generator=torch.Generator().manual_seed(3), device="cpu").to(DEVICE)
    e = emb_d(ids)
    de = full(e.shape, 4, dtype)
    e.backward(de)
    el = emb(ids)
    el.backward(de)
    errs["emb"] = rel(el, e)
    errs["emb.dW"] = rel(emb.dense_state(grad=True)["weight"], emb_d.weight.grad)

    logits = full((2, 4, 4 * n), 5, dtype).requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 4 * n), ids.reshape(-1), reduction="none")
    dl = full(loss.shape, 6, dtype)
    loss.backward(dl)
    ll = gw.scatter(logits.detach(), gw.Layout((), (), ("tp",)), grid).requires_grad_()
    grid.reset_stats()
    lossl = gw.nn.vocab_parallel_cross_entropy(ll, ids, grid)
    ce_bytes = sum(v["sent_intra"]["bytes"] + v["sent_inter"]["bytes"] for v in grid.stats().values())
    lossl.backward(dl.reshape(2, 4))
    errs["ce"] = rel(lossl.reshape(-1), loss)
    errs["ce.grad"] = rel(gw.gather(ll.grad, gw.Layout((), (), ("tp",)), grid), logits.grad)
    return errs, ce_bytes


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_megatron_1d_modules(pool, n, dtype):
    limit = 1e-10 if dtype == "float64" else 1e-5
    elem = 8 if dtype == "float64" else 4
    for errs, ce_bytes in pool.run(_one_d, n, dtype):
        assert max(errs.values()) < limit, errs
        # The fused cross-entropy moves 3 values per token (max; sum-exp and target logit),
        # each by a ring all-reduce, never the b x s x v logits: 2(g-1)/g * 3*b*s values.
        assert ce_bytes == 2 * (n - 1) * 3 * 8 * (8 if dtype == "float64" else 4) // n
        assert ce_bytes < 2 * 4 * 4 * n * elem


def _two_d(ctx, dtype_name):
    import gridweave as gw

    dtype = getattr(torch, dtype_name)
    grid = ctx.init(tp=gw.Square(2))
    torch.manual_seed(0)
    errs = {}
    for bias in (True, False):
        dense = torch.nn.Linear(6, 12, bias=bias, dtype=dtype, device=DEVICE)
        lin = gw.nn.Linear2D.from_dense(dense, grid)
        ln_d = torch.nn.LayerNorm(12, dtype=dtype, device=DEVICE)
        with torch.no_grad():
            ln_d.weight.copy_(full((12,), 7, dtype))
            ln_d.bias.copy_(full((12,), 8, dtype))
        ln = gw.nn.LayerNorm2D.from_dense(ln_d, grid)
        x = full((4, 3, 6), 1, dtype).requires_grad_()
        y = ln_d(dense(x))
        dy = full(y.shape, 2, dtype)
        y.backward(dy)
        xl = gw.scatter(x.detach(), lin.input_layout, grid).requires_grad_()
        yl = ln(lin(xl))
        yl.backward(gw.scatter(dy, ln.output_layout, grid))
        g, gl = lin.dense_state(grad=True), ln.dense_state(grad=True)
        errs[f"y{bias}"] = rel(gw.gather(yl, ln.output_layout, grid), y)
        errs[f"dx{bias}"] = rel(gw.gather(xl.grad, lin.input_layout, grid), x.grad)
        errs[f"dW{bias}"] = rel(g["weight"], dense.weight.grad)
        if bias:
            errs["db"] = rel(g["bias"], dense.bias.grad)
        errs[f"ln.dw{bias}"] = rel(gl["weight"], ln_d.weight.grad)
        errs[f"ln.db{bias}"] = rel(gl["bias"], ln_d.bias.grad)
        errs[f"to_dense{bias}"] = rel(lin.to_dense().weight, dense.weight)
    return errs


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_summa_2d_modules(pool, dtype):
    limit = 1e-10 if dtype == "float64" else 1e-5
    for errs in pool.run(_two_d, 4, dtype):
        assert max(errs.values()) < limit, errs


def _bad_shapes(ctx, mode):
    import gridweave as gw

    grid = ctx.init(tp=gw.Row(4) if mode == "1d" else gw.Square(2))
    makers = {
        "1d": [lambda: gw.nn.ColumnParallelLinear(8, 6, grid), lambda: gw.nn.RowParallelLinear(10, 8, grid),
               lambda: gw.nn.VocabParallelEmbedding(10, 4, grid),
               lambda: gw.nn.TransformerLayer(16, 6, grid, mode="1d")],
        "2d": [lambda: gw.nn.Linear2D(8, 6, grid), lambda: gw.nn.Linear2D(5, 8, grid),
               lambda: gw.nn.LayerNorm2D(6, grid), lambda: gw.nn.TransformerLayer(16, 3, grid, mode="2d"),
               lambda: gw.scatter(torch.zeros(3, 2, 8, device=DEVICE), gw.Layout(("r",), (), ("c",)), grid)],
    }[mode]
    return grid_errors(makers)


@pytest.mark.parametrize("mode,n", [("1d", 4), ("2d", 4)])
def test_shapes_the_grid_does_not_divide_fail_on_every_rank(pool, mode, n):
    for msgs in pool.run(_bad_shapes, n, mode):
        assert all(m is not None for m in msgs), msgs
