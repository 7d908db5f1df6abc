"""3-D matrix products (Bian et al., Algorithms 1-6) and vector ops (Algorithms 7-8) as
autograd Functions. The plan of every step comes from the engine (cpp/cube.h); the
local GEMMs are torch."""
from __future__ import annotations

import torch

from .. import _C, float8, split
from ..errors import GridError
from ..grid import Work, by_name
from ..layout import Layout
from . import ops

AB, ABT, ATB = _C.CubeForm.AB, _C.CubeForm.ABt, _C.CubeForm.AtB
assert (int(AB), int(ABT), int(ATB)) == (0, 1, 2)  # the codes the custom ops carry (cpp/cube.h)


# The directions (a, c) of a layer's input: Algorithm 1's a = "y", c = "z".
INPUT_DIRECTIONS = ("y", "z")


def matrix_layout(form, operand, a, c) -> Layout:
    """The engine's layout of one operand of a cube product, as a Layout of the matrix."""
    return Layout(*[tuple(d) for d in _C.cube_layout(form, operand, a, c)])


def vector_layout(col) -> Layout:
    """Algorithms 7-8: the diagonal storage of a vector over columns split by `col` (the engine's)."""
    return Layout(*[tuple(d) for d in _C.cube_vector_layout(col)])


def activation_layout(a, c) -> Layout:
    """(batch, seq, hidden) of an activation in directions (a, c): the rows of Algorithm 1's
    A [(x, a) | c] are (batch, seq) flattened, so the batch takes the row split."""
    rows, cols = matrix_layout(_C.CubeForm.AB, 0, a, c).dims
    return Layout(rows, (), cols)


def output_directions(a, c) -> tuple:
    """Directions (a', c') of a product's output C, read off the engine's layout of C
    [(x, c) | a]: its rows are split like an input's over (x, a'), its columns over c'."""
    rows, cols = _C.cube_layout(_C.CubeForm.AB, 2, a, c)
    return ([r for r in rows if r != "x"][0], cols[0])


def _resolve(r):
    return r.wait() if isinstance(r, Work) else r


def _gather(grid, t, step, async_op, cache):
    key = (id(t), step.axis, step.dim)
    if cache is not None and key in cache:
        return cache[key]
    r = grid.all_gather(t, axis=step.axis, dim=step.dim, async_op=async_op)
    if cache is not None:
        cache[key] = r
    return r


def _product(grid, form, lhs, rhs, a, c, overlap, cache=None, rhs_gathered=None, async_out=False, recipe=None,
             role=None):
    """One of Algorithms 1, 3, 5: all-gather lhs and rhs, local GEMM (in float8 as a linear's `role`
    product where a recipe is given), reduce-scatter."""
    plan = _C.cube_plan(form, a, c)
    # The rhs gather (the weights, on x) is issued first and asynchronously when
    # overlapping, so it runs beside the lhs gather on another communicator.
    r = rhs_gathered if rhs_gathered is not None else _gather(grid, rhs, plan.gather_rhs, overlap, cache)
    lhs_full = _resolve(_gather(grid, lhs, plan.gather_lhs, False, cache))
    rhs_full = _resolve(r)
    if cache is not None:
        cache[(id(rhs), plan.gather_rhs.axis, plan.gather_rhs.dim)] = rhs_full
        cache[(id(lhs), plan.gather_lhs.axis, plan.gather_lhs.dim)] = lhs_full
    out = float8.matmul(lhs_full.t() if plan.trans_lhs else lhs_full, rhs_full.t() if plan.trans_rhs else rhs_full,
                        recipe, role).contiguous()
    rs = plan.reduce_scatter_out
    return grid.reduce_scatter(out, axis=rs.axis, dim=rs.dim, async_op=async_out)


class _CubeMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lhs, rhs, grid, form, a, c, overlap, rhs_gathered, deferred, recipe):
        ctx.grid, ctx.form, ctx.a, ctx.c, ctx.overlap, ctx.deferred = grid, form, a, c, overlap, deferred
        ctx.recipe = recipe
        ctx.save_for_backward(lhs, rhs)
        return _product(grid, form, lhs, rhs, a, c, overlap, rhs_gathered=rhs_gathered, recipe=recipe,
                        role=float8.Product.OUTPUT)

    @staticmethod
    def backward(ctx, g):
        lhs, rhs = ctx.saved_tensors
        ops = {0: lhs, 1: rhs, 2: g.contiguous()}
        grad_a, grad_b = _C.cube_backward(ctx.form, ctx.a, ctx.c)  # Algorithm 2: dA = dC B^T, dB = A^T dC
        cache = {}  # dC is all-gathered once for both gradients

        def grad(spec, role, overlap, cache):
            return _product(ctx.grid, spec.form, ops[spec.lhs], ops[spec.rhs], spec.a, spec.c, overlap, cache,
                            async_out=overlap, recipe=ctx.recipe, role=role)
        works = [grad(spec, role, ctx.overlap, cache) if needed else None
                 for spec, role, needed in ((grad_a, float8.Product.GRAD_INPUT, ctx.needs_input_grad[0]),
                                            (grad_b, float8.Product.GRAD_WEIGHT, ctx.needs_input_grad[1]))]
        if ctx.deferred is not None:  # the weight's product in W, in the table's order on every rank of the cube
            mine = {id(ops[grad_b.lhs]), id(ops[grad_b.rhs])}  # W keeps B's gathers of its own operands alone
            kept = {k: t for k, t in cache.items() if k[0] in mine}
            split.defer(*ctx.deferred, lambda: (grad(grad_b, float8.Product.GRAD_WEIGHT, False, kept),))
        da, db = (_resolve(w) for w in works)
        return da, db, None, None, None, None, None, None, None, None


def product(grid, form, lhs, rhs, a, c):
    """One product, synchronously (ops.cube_product's kernel)."""
    return _product(grid, form, lhs, rhs, a, c, False)


def cube_matmul(lhs, rhs, grid, form=AB, a="y", c="z", overlap=False, rhs_gathered=None, store=None, recipe=None):
    """C = op(lhs) op(rhs) on the cube; operand layouts are _C.cube_layout(form, k, a, c). rhs's
    gradient waits for W where `store` defers now (gw.split). recipe: a linear's products (form AB,
    lhs X, rhs W^T) in float8 on each rank's gathered blocks. Under torch.compile:
    ops.cube_matmul (no overlap: its gathers are one opaque op; nothing deferred; no float8)."""
    if recipe is not None and form is not AB:
        raise GridError("cube_matmul: float8 products are a linear's (form AB: X times W^T)")
    if torch.compiler.is_compiling():
        if recipe is not None:
            raise GridError("cube_matmul under torch.compile has no float8 products; call it eagerly")
        code = 0 if form is AB else 1 if form is ABT else 2  # int(form) of a pybind enum breaks dynamo's trace
        return _cube_matmul_op(lhs.contiguous(), rhs.contiguous(), grid.name, code, a, c)
    deferred, (rhs,) = split.deferral(store, lhs, (rhs,))
    return _CubeMatmul.apply(lhs.contiguous(), rhs.contiguous(), grid, form, a, c, overlap, rhs_gathered, deferred,
                             recipe)


def is_diagonal(grid, col_axis, row_axis) -> bool:
    """Vector parameters live on the ranks whose row and column directions agree (Fig. 5)."""
    return grid.coords[col_axis] == grid.coords[row_axis]


class _CubeVector(torch.autograd.Function):
    """Algorithm 7: broadcast the diagonal block along `row_axis`, all-gather it in x.
    Algorithm 8 (its adjoint): reduce-scatter the gradient in x, reduce it to the
    diagonal along `row_axis`."""

    @staticmethod
    def forward(ctx, b_local, grid, col_axis, row_axis, n_local):
        ctx.grid, ctx.col, ctx.row = grid, col_axis, row_axis
        ctx.diag = is_diagonal(grid, col_axis, row_axis)
        ctx.root = grid.coords[col_axis]
        buf = b_local.detach().clone() if ctx.diag else torch.empty(n_local, dtype=b_local.dtype, device=b_local.device)
        grid.broadcast(buf, axis=row_axis, src=ctx.root)
        ctx.inner = _C.cube_vector_layout(col_axis)[0][1]  # the diagonal block's split (x)
        return grid.all_gather(buf, axis=ctx.inner)

    @staticmethod
    def backward(ctx, g):
        part = ctx.grid.reduce_scatter(g.contiguous(), axis=ctx.inner)
        ctx.grid.reduce(part, axis=ctx.row, dst=ctx.root)
        return (part if ctx.diag else g.new_empty(0)), None, None, None, None


def cube_vector(b_local, grid, col_axis, row_axis, n_local):
    """The block of a diagonally stored vector that matches columns split by `col_axis`."""
    if torch.compiler.is_compiling():
        return _cube_vector_op(b_local, grid.name, col_axis, row_axis, n_local)
    return _CubeVector.apply(b_local, grid, col_axis, row_axis, n_local)


# ---- the same as torch custom ops (ops.py), what cube_matmul and cube_vector run under torch.compile


def _gathered_shape(x, step, grid):
    shape = list(x.shape)
    shape[step.dim] *= grid.size(step.axis)
    return shape


@torch.library.custom_op(f"{ops.LIB}::cube_product", mutates_args=())
def cube_product(lhs: torch.Tensor, rhs: torch.Tensor, grid: str, form: int, a: str, c: str) -> torch.Tensor:
    """One of Algorithms 1, 3, 5: all-gather both operands, local GEMM, reduce-scatter."""
    return product(by_name(grid), _C.CubeForm(form), lhs.contiguous(), rhs.contiguous(), a, c).contiguous()


@cube_product.register_fake
def _(lhs, rhs, grid, form, a, c):
    g = by_name(grid)
    plan = _C.cube_plan(_C.CubeForm(form), a, c)
    ls, rs = _gathered_shape(lhs, plan.gather_lhs, g), _gathered_shape(rhs, plan.gather_rhs, g)
    rows = ls[1] if plan.trans_lhs else ls[0]
    cols = rs[0] if plan.trans_rhs else rs[1]
    shape = [rows, cols]
    shape[plan.reduce_scatter_out.dim] //= g.size(plan.reduce_scatter_out.axis)
    return lhs.new_empty(shape)


@torch.library.custom_op(f"{ops.LIB}::cube_matmul", mutates_args=())
def _cube_matmul_op(lhs: torch.Tensor, rhs: torch.Tensor, grid: str, form: int, a: str, c: str) -> torch.Tensor:
    return cube_product(lhs, rhs, grid, form, a, c)


_cube_matmul_op.register_fake(lambda lhs, rhs, grid, form, a, c: cube_product(lhs, rhs, grid, form, a, c))


def _setup_cube(ctx, inputs, output):
    lhs, rhs, ctx.grid, ctx.form, ctx.a, ctx.c = inputs
    ctx.save_for_backward(lhs, rhs)


def _cube_backward(ctx, g):  # Bian et al. §3.1.2: each gradient is another of the three products
    lhs, rhs = ctx.saved_tensors
    operands = {0: lhs, 1: rhs, 2: g.contiguous()}
    grads = []
    for spec, needed in zip(_C.cube_backward(_C.CubeForm(ctx.form), ctx.a, ctx.c), ctx.needs_input_grad[:2]):
        grads.append(cube_product(operands[spec.lhs], operands[spec.rhs], ctx.grid, int(spec.form), spec.a, spec.c)
                     if needed else None)
    return grads[0], grads[1], None, None, None, None


torch.library.register_autograd(f"{ops.LIB}::cube_matmul", _cube_backward, setup_context=_setup_cube)


def _vector_roles(grid, col, row):
    """(on the diagonal, the diagonal's index along row, the x-like axis of the gather)."""
    coords = grid.coords
    return coords[col] == coords[row], coords[col], _C.cube_vector_layout(col)[0][1]


@torch.library.custom_op(f"{ops.LIB}::cube_vector", mutates_args=())
def _cube_vector_op(b: torch.Tensor, grid: str, col: str, row: str, n: int) -> torch.Tensor:
    """Algorithm 7: broadcast the diagonal block along `row`, all-gather it in x."""
    g = by_name(grid)
    diag, root, inner = _vector_roles(g, col, row)
    buf = b.detach().clone() if diag else torch.empty(n, dtype=b.dtype, device=b.device)
    g.broadcast(buf, axis=row, src=root)
    return g.all_gather(buf, axis=inner)


@_cube_vector_op.register_fake
def _(b, grid, col, row, n):
    g = by_name(grid)
    return b.new_empty(n * g.size(_vector_roles(g, col, row)[2]))


def _setup_vector(ctx, inputs, output):
    _, ctx.grid, ctx.col, ctx.row, _ = inputs


@torch.library.custom_op(f"{ops.LIB}::cube_vector_grad", mutates_args=())
def _cube_vector_grad_op(g: torch.Tensor, grid: str, col: str, row: str) -> torch.Tensor:
    """Algorithm 8: reduce-scatter in x, reduce to the diagonal along row: the block's gradient
    on the diagonal, a partial sum elsewhere. One op of one shape on every rank: compilers
    drop or move kernels whose outputs are empty, and a rank must issue every collective."""
    gr = by_name(grid)
    part = gr.reduce_scatter(g.contiguous(), axis=_C.cube_vector_layout(col)[0][1])
    return gr.reduce(part, axis=row, dst=gr.coords[col])


@_cube_vector_grad_op.register_fake
def _(g, grid, col, row):
    return g.new_empty(g.shape[0] // by_name(grid).size(_vector_roles(by_name(grid), col, row)[2]))


def _vector_backward(ctx, g):
    part = _cube_vector_grad_op(g, ctx.grid, ctx.col, ctx.row)
    diag = _vector_roles(by_name(ctx.grid), ctx.col, ctx.row)[0]
    return (part if diag else part.narrow(0, 0, 0)), None, None, None, None


torch.library.register_autograd(f"{ops.LIB}::cube_vector", _vector_backward, setup_context=_setup_vector)


ops.keep_alive(cube_product, _cube_matmul_op, _cube_vector_op, _cube_vector_grad_op)
