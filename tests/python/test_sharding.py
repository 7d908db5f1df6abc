"""Parameter placements and the one gradient rule: gw.reduce_gradients and gw.clip_grad_norm_
on a GPT over every tensor mode composed with dp, pp and sp give torch's dense gradients,
global norm and clipped gradients (float64, 1e-10)."""
import pytest
import torch

from tp_refs import DEVICE, full, rel

V, H, HEADS, LAYERS, SEQ, BATCH = 32, 16, 4, 4, 8, 8
CPU = torch.device("cpu")


def _data():
    g = torch.Generator(device=CPU).manual_seed(7)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g, device=CPU)
    return ids[:, :-1], ids[:, 1:]


def _dense_reference(max_norm_fraction):
    """Plain torch: the dense GPT's gradient of the batch mean loss, its norm, and the
    gradients torch.nn.utils.clip_grad_norm_ leaves."""
    import gridweave as gw

    torch.manual_seed(0)
    model = gw.models.GPT(V, H, HEADS, LAYERS, SEQ, dtype=torch.float64, device=CPU)
    x, y = _data()
    model.loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # the norm only
    max_norm = float(norm) * max_norm_fraction
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return model, float(norm), max_norm, {k: p.grad.clone() for k, p in model.named_parameters()}


def _grid_run(ctx, spec, dp, pp, sp, max_norm_fraction):
    import gridweave as gw

    mode = gw.modes.parse(spec)
    grid = ctx.init(dp=dp, pp=pp, sp=sp, tp=mode)
    dense, ref_norm, max_norm, ref_grads = _dense_reference(max_norm_fraction)
    torch.manual_seed(0)  # the reference's weights: drawn on the host, then moved
    model = gw.models.GPT(V, H, HEADS, LAYERS, SEQ, dtype=torch.float64, device=CPU).to(grid.device)
    stage = gw.models.GPTStage(model, grid, mode, grid.coords["pp"], pp)
    x, y = (t.to(grid.device) for t in _data())  # the reference's batch, on the grid's device
    shard, m = BATCH // dp, 2
    mb = shard // m
    lo = grid.coords["dp"] * shard
    xs = [x[lo + i * mb:lo + (i + 1) * mb] for i in range(m)]
    ys = [y[lo + i * mb:lo + (i + 1) * mb] for i in range(m)]
    # each rank's loss is its share of the global mean: the gradient is then a plain sum
    gw.pipeline.pipeline_step(stage, grid, xs, ys, lambda o, t: stage.loss(o, t) / dp,
                              stage.activation_shape(mb, SEQ), dtype=torch.float64)
    gw.reduce_gradients(stage, grid)
    norm = gw.clip_grad_norm_(stage.parameters(), max_norm, grid)
    errs = {"norm": abs(float(norm) - ref_norm) / ref_norm}
    for name, g in stage.dense_state(pick=True).items():
        errs[name] = rel(g, ref_grads[name])
    return errs, grid.device.type


COMPOSITIONS = [
    ("row:2", 2, 2, 1),       # Megatron 1-D x dp x pipeline
    ("row:2", 1, 2, 2),       # 1-D x ring attention x pipeline
    ("square:2", 1, 2, 1),    # SUMMA x pipeline
    ("cube:2", 1, 1, 1),      # Bian et al.'s cube (diagonal vectors)
    ("none", 2, 2, 2),        # sequence parallel x dp x pipeline
    ("subgraph:2", 2, 2, 1),  # SUPER D&SP x dp x pipeline
    ("csub:2", 1, 2, 2),      # cSub x ring attention x pipeline
]


@pytest.mark.parametrize("spec,dp,pp,sp", COMPOSITIONS)
def test_clip_grad_norm_equals_torch_on_every_composition(pool, spec, dp, pp, sp):
    for errs, device in pool.run(_grid_run, 8, spec, dp, pp, sp, 0.3):
        assert device == DEVICE.type
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


def test_a_norm_below_max_norm_leaves_gradients_unscaled(pool):
    for errs, _ in pool.run(_grid_run, 8, "cube:2", 1, 1, 1, 2.0):
        assert max(errs.values()) < 1e-10, errs


def _placements(ctx):
    import gridweave as gw

    grid = ctx.init(dp=1, tp=gw.Cube(2))
    layer = gw.nn.TransformerLayer(16, 4, grid, device=grid.device, dtype=torch.float64)
    out = {}
    for name, p in layer.named_parameters():
        pl = gw.placement_of(p)
        out[name] = (sorted(pl.layout.axes()), pl.partial, pl.diagonal, pl.counted_here(grid), p.numel())
    return out


def test_every_parameter_of_a_cube_layer_is_counted_exactly_once(pool):
    """Over the 8 ranks each stored element is counted by exactly one rank: the counted shards of
    each parameter add up to its dense size (diagonal vectors included)."""
    dense = {"attn.qkv.weight": 16 * 48, "attn.qkv.bias": 48, "attn.proj.weight": 256, "attn.proj.bias": 16,
             "mlp.fc1.weight": 16 * 64, "mlp.fc1.bias": 64, "mlp.fc2.weight": 64 * 16, "mlp.fc2.bias": 16,
             "ln1.weight": 16, "ln1.bias": 16, "ln2.weight": 16, "ln2.bias": 16}
    res = pool.run(_placements, 8)
    for name, size in dense.items():
        assert sum(r[name][4] for r in res if r[name][3]) == size, name
    assert res[0]["attn.qkv.bias"][2] is not None and res[0]["attn.qkv.weight"][0] == ["x", "y", "z"]


def test_bad_clip_arguments_are_clear_errors():
    import gridweave as gw

    grid = gw.init()
    p = torch.nn.Parameter(torch.ones(3, device=CPU))
    p.grad = torch.ones(3, device=CPU)
    with pytest.raises(gw.GridError, match="max_norm"):
        gw.clip_grad_norm_([p], -1.0, grid)
    with pytest.raises(gw.GridError, match="split and partial"):
        gw.ParamPlacement(gw.Layout(("dp",)), partial=("dp",))
    gw.shutdown()


# ---- layouts that tell the whole truth (issue 29): scatter by a layer's own layout, backward,
# reduce_gradients, clip_grad_norm_ equal the dense layer in every mode with dp and sp
LH, LHEADS, LB, LS = 32, 8, 4, 8


def _layer_by_layout(ctx, spec, dp, sp):
    import gridweave as gw

    mode = gw.modes.parse(spec)
    grid = ctx.init(dp=dp, sp=sp, tp=mode)
    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(LH, LHEADS, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = full((LB, LS, LH), 11).requires_grad_()  # seeded, on the test device (never the default one)
    dy = full((LB, LS, LH), 12)
    y = dense(x)
    y.backward(dy)
    max_norm = 0.3 * float(torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf")))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm))
    layer = gw.nn.TransformerLayer.from_dense(dense, grid)
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    yl = layer(xl)
    yl.backward(gw.scatter(dy, layer.output_layout, grid))
    gw.reduce_gradients(layer, grid)
    norm = gw.clip_grad_norm_(layer.parameters(), max_norm, grid)
    errs = {"y": rel(gw.gather(yl, layer.output_layout, grid, y.shape), y),  # shape: cSub's empty shards
            "dx": rel(gw.gather(xl.grad, layer.input_layout, grid, x.shape), x.grad),
            "norm": abs(float(norm) - ref_norm) / ref_norm}
    grads = layer.dense_state(grad=True)
    errs.update({name: rel(grads[name], p.grad) for name, p in dense.named_parameters()})
    batch_axes = layer.input_layout.dims[0]
    return errs, batch_axes


LAYOUT_CASES = [("row:2", 2, 2), ("row:4", 2, 1), ("square:2", 2, 1), ("cube:2", 1, 1), ("none", 4, 2),
                ("subgraph:2", 2, 2), ("csub:2", 2, 2)]


@pytest.mark.parametrize("spec,dp,sp", LAYOUT_CASES)
def test_scatter_by_layout_then_reduce_and_clip_equals_dense(pool, spec, dp, sp):
    for errs, batch_axes in pool.run(_layer_by_layout, 8, spec, dp, sp):
        assert "dp" in batch_axes, batch_axes  # the batch splits over every axis the parameters are partial over
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
