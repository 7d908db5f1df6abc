"""Float8 products (gw.float8) against float64: within the error float8's rounding allows."""
import pytest
import torch

from tp_refs import DEVICE, full

import gridweave as gw
from gridweave import float8
from gridweave.errors import GridError

pytest.importorskip("torchao")

RECIPES = list(float8.Float8Recipe)


def _operand_error(t: torch.Tensor, u: float, dtype) -> torch.Tensor:
    """The most rounding one scaled operand to float8 can move each element: u |t| for normal
    numbers, half a subnormal step beneath (2 smallest_normal u / max of the format, times the
    tensor's absolute maximum; twice that for a scale rounded down to a power of 2)."""
    info = torch.finfo(dtype)
    return u * t.abs() + 2 * 2 * info.smallest_normal * u / info.max * t.abs().max()


def _bound(a: torch.Tensor, b: torch.Tensor, ua: float, ub: float, da, db, out: torch.Tensor) -> torch.Tensor:
    """|A'B' - AB| elementwise, A' and B' the operands rounded (each element within its error),
    plus fp32 accumulation over k and the product rounded to the output's bf16 (2^-8 of it)."""
    ea, eb = _operand_error(a, ua, da), _operand_error(b, ub, db)
    k = a.shape[-1]
    return (a.abs() @ eb + ea @ b.abs() + ea @ eb + k * 2.0 ** -24 * (a.abs() @ b.abs())
            + 2.0 ** -8 * out.abs())


def _dtype(recipe, role):
    return getattr(float8._config(recipe), f"cast_config_{role}").target_dtype


@pytest.mark.parametrize("emulate", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(64, 32, 48), (48, 96, 16), (32, 16, 160)])
def test_each_product_is_within_float8s_rounding_of_float64(recipe, shape, emulate, monkeypatch):
    """Y = X W^T, dX = dY W and dW = dY^T X in float8 against the same bf16 operands multiplied in
    float64: every element within the bound its operands' rounding allows (e4m3 2^-4 relative,
    e5m2 2^-3, subnormals and accumulation included), and the error that of float8, not bf16's;
    through torch._scaled_mm (a GPU's path) and emulated (the float8 values multiplied in fp32:
    the CPU's, where _scaled_mm is a reference loop)."""
    monkeypatch.setattr(float8, "emulated", lambda device: emulate)
    tokens, n_in, n_out = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(tokens, n_in, generator=g, device="cpu") * 3).to(torch.bfloat16)
    w = (torch.randn(n_out, n_in, generator=g, device="cpu") * 0.05).to(torch.bfloat16)
    dy = (torch.randn(tokens, n_out, generator=g, device="cpu") * 1e-3).to(torch.bfloat16)
    u = {r: recipe.unit_roundoff(r) for r in ("input", "weight", "grad_output")}
    d = {r: _dtype(recipe, r) for r in ("input", "weight", "grad_output")}
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    cases = [(float8.output(x, w, recipe), x64, w64.t(), "input", "weight"),
             (float8.grad_input(dy, w, recipe), dy64, w64, "grad_output", "weight"),
             (float8.grad_weight(dy, x, recipe), dy64.t(), x64, "grad_output", "input")]
    for got, a, b, ra, rb in cases:
        exact = a @ b
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        err = (got.double() - exact).abs()
        assert (err <= _bound(a, b, u[ra], u[rb], d[ra], d[rb], got.double())).all()
        rel = float(err.norm() / exact.norm())
        assert 2.0 ** -9 < rel < max(u[ra], u[rb])  # float8's error (above bf16's), far inside the worst case


@pytest.mark.parametrize("emulate", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_linear_equals_torchaos_float8_linear(recipe, emulate, monkeypatch):
    """gw.float8.linear forward and backward against torchao's own Float8Linear (its module swap,
    the same recipe, emulated or not alike) on the same bf16 values: output, input, weight and bias
    gradients bit for bit; and each of them the corresponding product of gw.float8 (output,
    grad_input, grad_weight)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(float8, "emulated", lambda device: emulate)

    g = torch.Generator().manual_seed(3)
    ref = torch.nn.Linear(32, 48, dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48, 32, generator=g, device="cpu") * 0.1)
        ref.bias.copy_(torch.randn(48, generator=g, device="cpu"))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe.value), emulate=emulate)
    theirs = Float8Linear.from_float(ref, config=config)
    x = torch.randn(4, 16, 32, generator=g, device="cpu").to(torch.bfloat16).requires_grad_()
    dy = torch.randn(4, 16, 48, generator=g, device="cpu").to(torch.bfloat16)
    w = ref.weight.detach().clone().requires_grad_()
    b = ref.bias.detach().clone().requires_grad_()
    y = float8.linear(x, w, b, recipe)
    y.backward(dy)
    xt = x.detach().clone().requires_grad_()
    yt = theirs(xt)
    yt.backward(dy)
    assert torch.equal(y, yt) and torch.equal(x.grad, xt.grad)
    assert torch.equal(w.grad, theirs.weight.grad) and torch.equal(b.grad, theirs.bias.grad)
    assert torch.equal(y, float8.output(x.detach(), w.detach(), recipe) + b.detach())
    assert torch.equal(x.grad, float8.grad_input(dy, w.detach(), recipe))
    assert torch.equal(w.grad, float8.grad_weight(dy, x.detach(), recipe))


def test_sizes_float8_cannot_take_are_one_clear_error():
    float8.check_sizes("a linear", 32, 64)
    with pytest.raises(GridError, match="multiple of 16, got 32, 40"):
        float8.check_sizes("a linear", 32, 40)


def test_the_recipes_round_as_their_formats():
    """e4m3 keeps 3 mantissa bits (2^-4), e5m2 2 (2^-3): tensorwise's gradients in e5m2, rowwise's in e4m3."""
    assert float8.Float8Recipe.TENSORWISE.unit_roundoff("input") == 2.0 ** -4
    assert float8.Float8Recipe.TENSORWISE.unit_roundoff("grad_output") == 2.0 ** -3
    assert float8.Float8Recipe.ROWWISE.unit_roundoff("grad_output") == 2.0 ** -4
    assert gw.float8.ALIGNMENT == 16


def _one_d_float8(ctx, recipe_name, sequence):
    """Megatron's column- then row-parallel linear with float8 products (each rank's on its shard),
    every output and gradient against the same bf16 values in float64, as (error, bound, |exact|)
    maxima; and, rowwise, the column-parallel output against the dense float8 product."""
    import gridweave as gw

    recipe = gw.float8.Float8Recipe(recipe_name)
    n = ctx.world_size
    grid = ctx.init(tp=gw.Row(n))
    bf = torch.bfloat16
    torch.manual_seed(0)
    col_d = torch.nn.Linear(32, 64, dtype=bf, device=DEVICE)
    row_d = torch.nn.Linear(64, 32, dtype=bf, device=DEVICE)
    col = gw.nn.ColumnParallelLinear.from_dense(col_d, grid, sequence=sequence)
    row = gw.nn.RowParallelLinear.from_dense(row_d, grid, sequence=sequence)
    assert gw.float8.convert(torch.nn.ModuleList([col, row]), recipe) == 2
    x = full((2, 16, 32), 1, bf)
    h = full((2, 16, 64), 2, bf)  # the row-parallel linear's input, whole
    dy_col, dy_row = full((2, 16, 64), 3, bf) * 1e-2, full((2, 16, 32), 4, bf) * 1e-2
    seq = gw.Layout((), ("tp",)) if sequence else None

    def local(t, layout):
        return (gw.scatter(t, layout, grid) if layout is not None else t).detach().requires_grad_()

    u = {r: recipe.unit_roundoff(r) for r in ("input", "weight", "grad_output")}
    d = {r: getattr(gw.float8._config(recipe), f"cast_config_{r}").target_dtype for r in u}
    out = {}

    def check(name, got, a, b, ra, rb, reduced=1):
        exact = a @ b
        bound = _bound(a, b, u[ra], u[rb], d[ra], d[rb], got) + reduced * 2.0 ** -8 * (a.abs() @ b.abs())
        out[name] = (float((got - exact).abs().max()), float(((got - exact).abs() - bound).max()),
                     float(((got - exact).norm() / exact.norm())))

    w1, w2 = col_d.weight.detach().double(), row_d.weight.detach().double()
    b1, b2 = col_d.bias.detach().double(), row_d.bias.detach().double()
    xl = local(x, seq)
    y1 = col(xl)
    y1.backward(gw.scatter(dy_col, col.output_layout, grid))
    x64, dy64 = x.double().reshape(-1, 32), dy_col.double().reshape(-1, 64)
    check("col.y", (gw.gather(y1, col.output_layout, grid).double().reshape(-1, 64) - b1), x64, w1.t(),
          "input", "weight")
    check("col.dx", gw.gather(xl.grad, seq, grid).double().reshape(-1, 32) if seq is not None else
          xl.grad.double().reshape(-1, 32), dy64, w1, "grad_output", "weight", reduced=n)
    check("col.dW", col.dense_state(grad=True)["weight"].double(), dy64.t(), x64, "grad_output", "input")
    if recipe is gw.float8.Float8Recipe.ROWWISE:  # the same rows, the same scales: the dense product itself
        out["col.y=dense"] = bool(torch.equal(gw.gather(y1, col.output_layout, grid).detach(),
                                              gw.float8.linear(x, col_d.weight, col_d.bias, recipe).detach()))
    hl = local(h, col.output_layout)
    y2 = row(hl)
    y2.backward(gw.scatter(dy_row, row.output_layout, grid) if sequence else dy_row)
    h64, dy64 = h.double().reshape(-1, 64), dy_row.double().reshape(-1, 32)
    got = gw.gather(y2, row.output_layout, grid) if sequence else y2
    check("row.y", got.double().reshape(-1, 32) - b2, h64, w2.t(), "input", "weight", reduced=n)
    check("row.dx", gw.gather(hl.grad, col.output_layout, grid).double().reshape(-1, 64), dy64, w2, "grad_output",
          "weight")
    check("row.dW", row.dense_state(grad=True)["weight"].double(), dy64.t(), h64, "grad_output", "input")
    return out


@pytest.mark.parametrize("n,sequence", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize("recipe", [r.value for r in RECIPES])
def test_megatron_1d_linears_in_float8_are_within_its_rounding(pool, n, sequence, recipe):
    """Column- and row-parallel linears (with Megatron's sequence parallelism too) in float8 on
    2 and 4 ranks: outputs, input gradients and weight gradients within the bound of their
    operands' rounding (the row-parallel sum's bf16 reductions added), float8's error (not bf16's),
    and rowwise, the column-parallel output the dense float8 product bit for bit."""
    for out in pool.run(_one_d_float8, n, recipe, sequence):
        for name, v in out.items():
            if name.endswith("=dense"):
                assert v, name
                continue
            err, over, rel = v
            assert over <= 0, (name, v)
            assert 2.0 ** -9 < rel < 2.0 ** -3, (name, v)


def _tiled_float8(ctx, recipe_name, cube):
    """A SUMMA linear (2-D, q = 2) with each step's local product in float8, or a 3-D linear (p = 2,
    Bian et al.'s Algorithms 1-2) with each rank's product of its gathered blocks in float8: output,
    input and weight gradients against the same bf16 values in float64 (as _one_d_float8)."""
    import gridweave as gw

    recipe = gw.float8.Float8Recipe(recipe_name)
    grid = ctx.init(tp=gw.Cube(2) if cube else gw.Square(2))
    bf = torch.bfloat16
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 64, dtype=bf, device=DEVICE)
    lin = (gw.nn.Linear3D if cube else gw.nn.Linear2D).from_dense(dense, grid)
    assert gw.float8.convert(lin, recipe) == 1
    x, dy = full((4, 16, 32), 1, bf), full((4, 16, 64), 3, bf) * 1e-2
    u = {r: recipe.unit_roundoff(r) for r in ("input", "weight", "grad_output")}
    d = {r: getattr(gw.float8._config(recipe), f"cast_config_{r}").target_dtype for r in u}
    xl = gw.scatter(x, lin.input_layout, grid).requires_grad_()
    y = lin(xl)
    y.backward(gw.scatter(dy, lin.output_layout, grid))
    w, b = dense.weight.detach().double(), dense.bias.detach().double()
    x64, dy64 = x.double().reshape(-1, 32), dy.double().reshape(-1, 64)
    out = {}
    for name, got, a, bm, ra, rb in (
            ("y", gw.gather(y, lin.output_layout, grid).double().reshape(-1, 64) - b, x64, w.t(), "input", "weight"),
            ("dx", gw.gather(xl.grad, lin.input_layout, grid).double().reshape(-1, 32), dy64, w, "grad_output",
             "weight"),
            ("dW", lin.dense_state(grad=True)["weight"].double(), dy64.t(), x64, "grad_output", "input")):
        exact = a @ bm
        # the 2 partial products' sums in bf16 (q's steps, or the cube's reduce-scatter and dp-like sums)
        bound = _bound(a, bm, u[ra], u[rb], d[ra], d[rb], got) + 2 * 2.0 ** -8 * (a.abs() @ bm.abs())
        out[name] = (float((got - exact).abs().max()), float(((got - exact).abs() - bound).max()),
                     float((got - exact).norm() / exact.norm()))
    return out


@pytest.mark.parametrize("cube", [False, True], ids=["summa-2x2", "cube-2x2x2"])
@pytest.mark.parametrize("recipe", [r.value for r in RECIPES])
def test_2d_and_3d_linears_in_float8_are_within_their_rounding(pool, recipe, cube):
    """Bian et al.'s 2-D baseline (SUMMA, each step's local product) on a 2 x 2 grid and their 3-D
    linear (each rank's product of its gathered blocks, forward and both gradients) on a 2 x 2 x 2
    cube, in float8: output and both gradients within their operands' rounding (the partial
    products' bf16 sums added), float8's error, not bf16's."""
    for out in pool.run(_tiled_float8, 8 if cube else 4, recipe, cube):
        for name, (err, over, rel) in out.items():
            assert over <= 0, (name, err, over, rel)
            assert 2.0 ** -9 < rel < 2.0 ** -3, (name, err, over, rel)


def test_a_linear_float8_cannot_take_is_refused_before_any_is_changed():
    """convert checks every linear (its local weight's sizes, its kind) before setting any."""
    import gridweave as gw

    class Fake(gw.nn.dense.ParallelLinearBase):
        FLOAT8 = True

        def __init__(self, shape):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(shape, device="cpu"))

    good, bad = Fake((32, 16)), Fake((32, 24))
    with pytest.raises(GridError, match="multiple of 16"):
        gw.float8.convert(torch.nn.ModuleList([good, bad]), float8.Float8Recipe.TENSORWISE)
    assert good.float8 is None and bad.float8 is None
    head = torch.nn.Module()
    head.head = Fake((16, 16))
    head.body = Fake((16, 16))
    assert gw.float8.convert(head, float8.Float8Recipe.ROWWISE) == 1
    assert head.head.float8 is None and head.body.float8 is float8.Float8Recipe.ROWWISE


ARGS = ["--steps", "12", "--hidden", "32", "--layers", "4", "--heads", "4", "--ffn-hidden", "96", "--seq", "32",
        "--batch", "8", "--tokenizer", "bytes", "--warmup", "2", "--val-every", "0", "--sample-tokens", "0", "--quiet"]


def _train(tmp, name, *extra, port):
    from test_precision import _train as train

    return train(tmp, name, *extra, port=port, args=ARGS)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("bf16"), "one", "--nproc", "1", "--precision", "bf16", port=29721)


MIXTRAL = ["--model", "mixtral", "--experts", "4", "--top-k", "2"]


@pytest.fixture(scope="module")
def mixtral_bf16(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("mixtral_bf16"), "one", "--nproc", "1", "--precision", "bf16", *MIXTRAL,
                  port=29729)


@pytest.mark.parametrize("precision,spec,port", [
    ("fp8", ["--nproc", "4", "--tp", "row:2", "--tp-sp", "--pp", "2"], 29723),
    ("fp8-rowwise", ["--nproc", "4", "--tp", "subgraph:2", "--dp", "2", "--pp", "1"], 29725),
    ("fp8", ["--nproc", "4", "--sp", "2", "--dp", "2", "--pp", "1", "--zero", "3"], 29727),
    ("fp8-rowwise", ["--nproc", "4", *MIXTRAL, "--ep", "2", "--dp", "4", "--pp", "1"], 29731)])
def test_the_main_job_in_float8_tracks_bf16_on_composed_grids(bf16, mixtral_bf16, tmp_path, precision, spec, port):
    """The main job with its linears in float8 on 1-D with Megatron's sequence parallelism and a
    pipeline, sub-graph x data, and sequence x data under ZeRO-3, and Mixtral with its experts'
    products in float8 over expert parallelism (ep 2 x dp 4): it learns, and each step's loss stays
    within 1% of bf16's on one process (measured: at most 0.1% over these 12 steps)."""
    losses = _train(tmp_path, precision, "--precision", precision, *spec, port=port)
    ref = mixtral_bf16 if "mixtral" in spec else bf16
    assert ref[-1] < ref[0] - 0.3 and losses[-1] < losses[0] - 0.3
    worst = max(abs(a - b) / b for a, b in zip(losses, ref))
    assert worst < 1e-2, (precision, spec, worst, losses, ref)


def test_what_float8_cannot_take_is_refused_before_any_rank_starts():
    import gridweave as gw

    def shape(world=4, **kw):
        cfg = gw.train.TrainConfig(**{**dict(hidden=32, heads=4, layers=4, ffn_hidden=96, seq=32, batch=8,
                                              tokenizer="bytes", precision="fp8"), **kw})
        return cfg.grid_shape(world)

    assert shape(tp="row:2") == {"dp": 1, "pp": 2, "sp": 1}
    assert shape(8, tp="cube:2") == {"dp": 1, "pp": 1, "sp": 1}
    with pytest.raises(GridError, match=r"tokens in a rank's products .* cube:2's 2 row parts\): .* got 40"):
        shape(8, tp="cube:2", batch=4, seq=20, microbatches=1)  # 80 tokens, 40 in each rank's products
    assert shape(model="mixtral", experts=4, ep=2, pp=1) == {"dp": 4, "pp": 1, "sp": 1}
    with pytest.raises(GridError, match="schedule zb1 defers a mixture of experts' weight gradients"):
        shape(model="mixtral", experts=4, pp=2, schedule="zb1")
    with pytest.raises(GridError, match=r"tokens in a rank.s products .* got 40"):
        shape(seq=20, dp=4, pp=1, microbatches=1)


@pytest.mark.parametrize("emulate", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_in_float8_equal_torchaos_float8_linear_per_expert(recipe, emulate, monkeypatch):
    """A mixture's expert products in float8 (swiglu_experts with a recipe: each expert its own
    scales) against torchao's Float8Linear holding each expert's gate_up and down: outputs and the
    rows', gate_up's and down's gradients bit for bit; an expert no row reached multiplies nothing,
    in bf16, and gets its zero gradient; 40 rows (the padded weight gradients of _scaled_mm's path)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from gridweave.nn.moe import swiglu_experts

    monkeypatch.setattr(float8, "emulated", lambda device: emulate)
    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    counts, hidden, ffn = [16, 0, 10, 14], 32, 16
    x = torch.randn(sum(counts), hidden, generator=g, device="cpu").to(bf).requires_grad_()
    gate_up = (torch.randn(4, 2 * ffn, hidden, generator=g, device="cpu") * 0.2).to(bf).requires_grad_()
    down = (torch.randn(4, hidden, ffn, generator=g, device="cpu") * 0.2).to(bf).requires_grad_()
    dy = (torch.randn(sum(counts), hidden, generator=g, device="cpu") * 1e-2).to(bf)
    y = swiglu_experts(x, counts, gate_up, down, recipe=recipe)
    y.backward(dy)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe.value), emulate=emulate)
    outs, grads = [], []
    for e, rows in enumerate(x.detach().split(counts)):
        rows = rows.clone().requires_grad_()
        lin = []
        for w in (gate_up[e], down[e]):
            m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=bf, device="cpu")
            with torch.no_grad():
                m.weight.copy_(w)
            lin.append(Float8Linear.from_float(m, config=config) if counts[e] else m)
        gate, up = lin[0](rows).chunk(2, dim=-1)
        out = lin[1](torch.nn.functional.silu(gate) * up)
        out.backward(dy[sum(counts[:e]):sum(counts[:e + 1])])
        outs.append(out.detach())
        grads.append((rows.grad, lin[0].weight.grad, lin[1].weight.grad))
    assert torch.equal(y.detach(), torch.cat(outs))
    assert torch.equal(x.grad, torch.cat([r for r, _, _ in grads]))
    assert torch.equal(gate_up.grad, torch.stack([w for _, w, _ in grads]))
    assert torch.equal(down.grad, torch.stack([w for _, _, w in grads]))
    assert not gate_up.grad[1].any() and not down.grad[1].any()


def test_checkpoints_hold_the_masters_so_fp8_and_bf16_resume_each_other(bf16, tmp_path):
    """A checkpoint holds the fp32 masters whatever the products ran in: an fp8 run resumed in fp8
    is the uninterrupted fp8 run; resumed in bf16 it continues as bf16 does (within 1% of bf16's
    uninterrupted losses). (The first run stops at the end of the warmup, where the learning rate
    does not yet depend on --steps.)"""
    def run(name, precision, *extra):
        out = tmp_path / name
        return _train(tmp_path, name, "--nproc", "1", "--precision", precision, *extra, port=29733), out

    full8, _ = run("full8", "fp8")
    _, half8 = run("half8", "fp8", "--steps", "2")
    again, _ = run("again", "fp8", "--resume", str(half8))
    assert again == full8, (again, full8)
    as_bf16, _ = run("as_bf16", "bf16", "--resume", str(half8))
    assert as_bf16[:2] == full8[:2]
    assert max(abs(a - b) / b for a, b in zip(as_bf16[2:], bf16[2:])) < 1e-2, (as_bf16, bf16)


def _zero3_float8_gathers(ctx, dp):
    """Two units of replicated linears (tensorwise float8) under ZeRO-3 over dp: the weights in float8
    groups of their own, the biases in bf16 ones. One unit's gather: the weights arrive as float8
    (one scale a weight from its amax over every shard, exactly torchao's cast of the whole weight,
    scaled back), the biases exact; the bytes each rank sends are (dp - 1) shards, of 1 byte an element
    in the float8 groups and 2 in the bf16 ones. The amaxes: one all-reduce of one float32 a weight.
    Whole parameters (a checkpoint's read) are exact, float8 groups included."""
    import gridweave as gw
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    grid = ctx.init(dp=dp)
    bf, recipe = torch.bfloat16, float8.Float8Recipe.TENSORWISE
    torch.manual_seed(0)
    units = torch.nn.ModuleList([torch.nn.Sequential(gw.nn.ReplicatedLinear(32, 48, dtype=bf, device=DEVICE),
                                                     gw.nn.ReplicatedLinear(48, 32, dtype=bf, device=DEVICE))
                                 for _ in range(2)])
    dense = {k: v.detach().clone() for k, v in units.state_dict().items()}  # every rank alike (seeded)
    assert float8.convert(units, recipe) == 4
    weights = float8.gathered_weights(units)
    opt = gw.optim.DistributedAdam(units.parameters(), grid, zero=3, units=list(units), float8_params=weights)
    kinds = sorted((g.float8, tuple(p.dim() for _, p in g.members)) for g in opt.groups if g.unit == 0)
    grid.reset_stats()
    opt.units.rescale()
    amax_sent = grid.stats()["dp"]
    grid.reset_stats()
    u0 = opt.units.units[0]
    opt.units.gather(u0)
    sent = grid.stats()["dp"]
    want = sum((dp - 1) * g.shard * (1 if g.float8 else 2) for g in u0.groups)
    e4m3 = float8.gather_dtype()
    got_exact, got_float8 = [], []
    for name, p in units[0].named_parameters():
        ref = dense[f"0.{name}"]
        if p.dim() == 2:
            scale = amax_to_scale(ref.abs().max().float(), e4m3)
            got_float8.append(torch.equal(p.detach(), (to_fp8_saturated(ref.float() * scale, e4m3).float() / scale)
                                          .to(bf)))
        else:
            got_exact.append(torch.equal(p.detach(), ref))
    opt.units.free_all()
    with opt.whole_parameters():
        whole = all(torch.equal(p.detach(), dense[k]) for k, p in units.named_parameters())
    refused = []
    for t in (torch.zeros(4, dtype=torch.uint8, device=DEVICE), torch.zeros(4, dtype=e4m3, device=DEVICE)):
        try:  # bytes are moved, never summed: refused before anything moves, on every rank alike
            grid.all_reduce(t, "dp")
        except Exception as e:  # noqa: BLE001
            refused.append("moved, not reduced" in str(e))
    return (kinds, sent["sent_intra"]["bytes"] + sent["sent_inter"]["bytes"], want,
            amax_sent["sent_intra"]["bytes"] + amax_sent["sent_inter"]["bytes"], got_float8, got_exact, whole
            and refused == [True, True])


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_gathers_float8_weights_with_one_scale_each_and_half_the_bytes(pool, dp):
    for kinds, sent, want, amax_sent, got_float8, got_exact, whole in pool.run(_zero3_float8_gathers, dp, dp):
        assert kinds == [(False, (1, 1)), (True, (2, 2))], kinds
        assert sent == want, (sent, want)
        # the amaxes: 4 weights' float32s, a ring all-reduce over dp (2 (dp - 1) chunks of 16 bytes / dp)
        assert amax_sent == 2 * (dp - 1) * 16 // dp, amax_sent
        assert got_float8 == [True, True] and got_exact == [True, True] and whole


def test_the_planner_costs_float8_products_at_their_rate_and_the_halved_gathers():
    """The planner's recording of an fp8 job (ZeRO-3 over dp 4): its float8 FLOPs are the linears'
    6 N tokens (N: the layers' linear weights, the head's bf16 aside: forward 2, backward 4), costed
    at Cluster.float8_gemm_flops; each layer's float8 gather carries its linear weights at 1 byte an
    element beside its norms at 2 (bf16: every element at 2); the step all-reduces one float32
    amax a float8 weight (over dp)."""
    import dataclasses

    import gridweave as gw
    from gridweave import plan
    from gridweave.plan.cluster import load_cluster
    from gridweave.plan.predict import _Costing, schedule_of
    from gridweave.plan.shape import GridShape

    h, ffn, layers, seq, batch, dp = 256, 768, 2, 128, 16, 4
    got = {}
    for precision in ("bf16", "fp8"):
        cfg = gw.train.TrainConfig(hidden=h, heads=8, layers=layers, seq=seq, batch=batch, ffn_hidden=ffn,
                                   tokenizer="bytes", precision=precision, zero=3)
        got[precision] = (cfg, schedule_of(plan.model_of(cfg), GridShape(dp=dp, zero=3), 1))
    cfg, s = got["fp8"]
    model = gw.models.build(cfg.model_config(256), device="meta")
    linear = sum(m.weight.numel() for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    norms = sum(p.numel() for p in model.layers[0].parameters()) - linear
    tokens = batch // dp * seq
    assert s.microbatch.float8_flops == 6 * tokens * layers * linear
    assert got["bf16"][1].microbatch.float8_flops == 0
    gathers = {precision: sorted((c.elem, c.nbytes) for c in sch.microbatch.collectives if c.op == "all_gather")
               for precision, (_, sch) in got.items()}
    assert (1, float(linear)) in gathers["fp8"] and (2, 2.0 * norms) in gathers["fp8"]
    assert (1, float(linear)) not in gathers["bf16"] and (2, 2.0 * (linear + norms)) in gathers["bf16"]
    amax = [c for c in s.step if c.op == "all_reduce" and c.axis == "dp"]
    assert [c.nbytes for c in amax] == [4.0 * 4 * layers]  # qkv, proj, fc1, fc2 a layer
    cluster = load_cluster("h100-ib")
    slow = dataclasses.replace(cluster, float8_gemm_flops=cluster.float8_gemm_flops / 2)
    fast, half = (_Costing(GridShape(dp=dp, zero=3), c).busy(s.microbatch) for c in (cluster, slow))
    assert half - fast == pytest.approx(s.microbatch.float8_flops / cluster.float8_gemm_flops, rel=1e-9)
