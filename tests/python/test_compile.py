"""Graph-friendly layers (issue 28): the collectives the layers call are torch custom ops
(gridweave.autograd.ops, cube.py) with fake kernels and registered autograd, so
torch.compile(fullgraph=True) of a 1-D and a 3-D TransformerLayer traces forward and
backward without a graph break (inductor, CPU) and equals eager and the dense layer."""
import pytest
import torch

from tp_refs import DEVICE, full, rel

H, HEADS, B, S = 32, 8, 4, 5


def _compiled_layer(ctx, mode):
    import gridweave as gw

    n = ctx.world_size
    # inductor compiles on each rank (8 C++ builds on 2 cores here): a peer can reach the first
    # collective minutes after another, so the grid waits longer than the pool's default
    grid = ctx.init(tp={"1d": gw.Row(n), "3d": gw.Cube(2)}[mode], timeout=500.0)
    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(H, HEADS, bias=True, dtype=torch.float32, device=DEVICE)
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode)
    x = full((B, S, H), 11, torch.float32).requires_grad_()
    y = dense(x)
    dy = full(y.shape, 12, torch.float32)
    y.backward(dy)
    dyl = gw.scatter(dy, layer.output_layout, grid)

    def run(module):
        layer.zero_grad(set_to_none=True)
        xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
        yl = module(xl)
        yl.backward(dyl)
        return yl.detach(), xl.grad, {k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}

    eager = run(layer)
    torch._dynamo.reset()
    # compile afresh: a cached graph from an earlier build of these ops would not test this one
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    got = run(compiled)
    errs = {"y vs eager": rel(got[0], eager[0]), "dx vs eager": rel(got[1], eager[1]),
            "y vs dense": rel(gw.gather(got[0], layer.output_layout, grid), y),
            "dx vs dense": rel(gw.gather(got[1], layer.input_layout, grid), x.grad)}
    assert set(got[2]) == set(eager[2])
    for k in eager[2]:
        errs[k] = rel(got[2][k], eager[2][k]) if eager[2][k].numel() else 0.0
    return errs


@pytest.mark.parametrize("mode,n", [("1d", 2), ("3d", 8)])
def test_a_layer_compiles_whole_and_equals_eager(pool, mode, n):
    for errs in pool.run(_compiled_layer, n, mode, timeout=600):
        assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}
