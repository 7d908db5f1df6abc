"""3-D (Bian et al.): Algorithms 1-8 and Linear3D / LayerNorm3D against dense torch on a 2x2x2 cube."""
import pytest
import torch

from refs import grid_errors
from tp_refs import DEVICE, full, rel

FORMS = ("AB", "ABt", "AtB")


def _forms(ctx, a, c, overlap):
    import gridweave as gw
    from gridweave.autograd.cube import cube_matmul
    from gridweave.autograd.cube import matrix_layout

    grid = ctx.init(tp=gw.Cube(2))
    M, N, K = 12, 8, 20  # non-square; each divisible by p^2 = 4
    shapes = {0: ((M, N), (N, K)), 1: ((M, K), (N, K)), 2: ((M, N), (M, K))}
    refs = {0: lambda A, B: A @ B, 1: lambda A, B: A @ B.t(), 2: lambda A, B: A.t() @ B}
    errs = {}
    for i, name in enumerate(FORMS):
        form = getattr(gw._C.CubeForm, name)
        (sa, sb) = shapes[i]
        A, B = full(sa, 1).requires_grad_(), full(sb, 2).requires_grad_()
        C = refs[i](A, B)
        dC = full(C.shape, 3)
        C.backward(dC)
        la, lb, lc = (matrix_layout(form, k, a, c) for k in range(3))
        A_loc = gw.scatter(A.detach(), la, grid).requires_grad_()
        B_loc = gw.scatter(B.detach(), lb, grid).requires_grad_()
        C_loc = cube_matmul(A_loc, B_loc, grid, form, a, c, overlap)
        assert tuple(C_loc.shape) == lc.local_shape(C.shape, grid), (name, C_loc.shape)
        C_loc.backward(gw.scatter(dC, lc, grid))
        errs[name] = (rel(gw.gather(C_loc, lc, grid), C), rel(gw.gather(A_loc.grad, la, grid), A.grad),
                             rel(gw.gather(B_loc.grad, lb, grid), B.grad))
    return errs


@pytest.mark.parametrize("a,c", [("y", "z"), ("z", "y")])
@pytest.mark.parametrize("overlap", [False, True])
def test_algorithms_1_to_6_forward_and_backward(pool, a, c, overlap):
    for errs in pool.run(_forms, 8, a, c, overlap):
        for form, e in errs.items():
            assert max(e) < 1e-12, (form, e)


def _linear(ctx, bias, overlap, dtype_name, in_f, out_f):
    import gridweave as gw

    dtype = getattr(torch, dtype_name)
    grid = ctx.init(tp=gw.Cube(2))
    torch.manual_seed(0)
    dense = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype, device=DEVICE)
    lin = gw.nn.Linear3D.from_dense(dense, grid, overlap=overlap)
    x = full((4, 3, in_f), 5, dtype).requires_grad_()
    y = dense(x)
    dy = full(y.shape, 6, dtype)
    y.backward(dy)
    x_loc = gw.scatter(x.detach(), lin.input_layout, grid).requires_grad_()
    if overlap:
        lin.prefetch()
    y_loc = lin(x_loc)
    y_loc.backward(gw.scatter(dy, lin.output_layout, grid))
    g = lin.dense_state(grad=True)
    back = lin.to_dense()
    errs = {"y": rel(gw.gather(y_loc, lin.output_layout, grid), y),
            "dx": rel(gw.gather(x_loc.grad, lin.input_layout, grid), x.grad),
            "dW": rel(g["weight"], dense.weight.grad),
            "to_dense": rel(back.weight, dense.weight)}
    if bias:
        errs["db"] = rel(g["bias"], dense.bias.grad)
        errs["to_dense_b"] = rel(back.bias, dense.bias)
    return errs


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_linear3d_matches_dense(pool, bias, overlap, dtype):
    limit = 1e-10 if dtype == "float64" else 1e-5
    for errs in pool.run(_linear, 8, bias, overlap, dtype, 12, 20):
        assert max(errs.values()) < limit, errs


def _layernorm(ctx):
    import gridweave as gw

    grid = ctx.init(tp=gw.Cube(2))
    dense = torch.nn.LayerNorm(16, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        dense.weight.copy_(full((16,), 7))
        dense.bias.copy_(full((16,), 8))
    out = {}
    for a, c in (("y", "z"), ("z", "y")):
        ln = gw.nn.LayerNorm3D.from_dense(dense, grid, a=a, c=c)
        dense.zero_grad()
        x = full((4, 3, 16), 9).requires_grad_()
        y = dense(x)
        dy = full(y.shape, 10)
        y.backward(dy)
        x_loc = gw.scatter(x.detach(), ln.input_layout, grid).requires_grad_()
        y_loc = ln(x_loc)
        y_loc.backward(gw.scatter(dy, ln.output_layout, grid))
        g = ln.dense_state(grad=True)
        out[a + c] = (rel(gw.gather(y_loc, ln.output_layout, grid), y),
                      rel(gw.gather(x_loc.grad, ln.input_layout, grid), x.grad),
                      rel(g["weight"], dense.weight.grad), rel(g["bias"], dense.bias.grad),
                      sum(p.numel() for p in ln.parameters()))
    return grid.coords, out


def test_layernorm3d_matches_dense_with_diagonal_storage(pool):
    for coords, out in pool.run(_layernorm, 8):
        for dirs, (ey, edx, edw, edb, nparams) in out.items():
            assert max(ey, edx, edw, edb) < 1e-10, (dirs, ey, edx, edw, edb)
            diagonal = coords["y"] == coords["z"]
            assert nparams == (2 * 16 // 4 if diagonal else 0)  # gamma, beta: h/p^2 each on the diagonal


def _bytes(ctx, M_rows, N, K):
    import gridweave as gw

    grid = ctx.init(tp=gw.Cube(2))
    lin = gw.nn.Linear3D(N, K, grid, bias=False, dtype=torch.float64)
    x = torch.randn(M_rows // 4, 1, N // 2, dtype=torch.float64, requires_grad=True, device=DEVICE)
    grid.reset_stats()
    y = lin(x)
    fwd = grid.stats()
    grid.reset_stats()
    y.backward(torch.ones_like(y))
    bwd = grid.stats()

    def sent(s):
        return sum(v["sent_intra"]["bytes"] + v["sent_inter"]["bytes"] for v in s.values())

    return sent(fwd), sent(bwd)


def test_linear3d_bytes_equal_the_papers_count(pool):
    p, M, N, K, elem = 2, 16, 12, 20, 8
    # Bian et al. §3.1.2: forward all-gathers A (M/p^2 x N/p) and B (N/p x K/p^2) over p
    # ranks and reduce-scatters C (M/p x K/p): (p-1)(MN + NK + MK)/p^3 elements per rank.
    fwd = (p - 1) * (M * N + N * K + M * K) // p ** 3 * elem
    # Backward (Algorithms 2 via 3 and 5): all-gather dC (once, shared), B and A; reduce-
    # scatter dA (M/p x N/p) and dB (N/p x K/p): (p-1)(2MN + 2NK + MK)/p^3.
    bwd = (p - 1) * (2 * M * N + 2 * N * K + M * K) // p ** 3 * elem
    for f, b in pool.run(_bytes, 8, M, N, K):
        assert (f, b) == (fwd, bwd)


def _bad_shapes(ctx):
    import gridweave as gw

    grid = ctx.init(tp=gw.Cube(2))
    return grid_errors((lambda: gw.nn.Linear3D(12, 6, grid), lambda: gw.nn.Linear3D(9, 8, grid),
                        lambda: gw.nn.LayerNorm3D(6, grid),
                        lambda: gw.nn.TransformerLayer(16, 3, grid, mode="3d")))


def test_shapes_the_cube_does_not_divide_fail_on_every_rank(pool):
    for msgs in pool.run(_bad_shapes, 8):
        assert all(m is not None for m in msgs), msgs
        assert "out_features = 6" in msgs[0] and "in_features = 9" in msgs[1] and "3 heads" in msgs[3]
