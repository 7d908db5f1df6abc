"""Float8 matrix products for training, on torchao's float8 pieces (its recipes' casts and dynamic
scales, torch._scaled_mm beneath): a linear layer's three products, Y = X W^T, dX = dY W and
dW = dY^T X, each operand cast to float8 with a scale taken from its own absolute maximum (one a
tensor, or one a row of the contraction), multiplied with fp32 accumulation, the result in the
operands' precision. gridweave's layers call these inside their own autograd Functions, on each
rank's local blocks (a 1-D shard, a SUMMA tile, a 3-D block), so a layer carries its recipe as it
carries its grid. torchao is imported on first use: a run that never asks for float8 never loads it."""
from __future__ import annotations

import enum
import logging
import sys
from functools import lru_cache

import torch

from .errors import GridError

# products float8 kernels take: every dimension a multiple of this (cuBLASLt's rule for _scaled_mm)
ALIGNMENT = 16


class Float8Recipe(enum.Enum):
    """How operands are scaled (torchao's recipe names)."""
    TENSORWISE = "tensorwise"  # one scale a tensor: e4m3 inputs and weights, e5m2 gradients
    ROWWISE = "rowwise"  # one power-of-2 scale a row of the contraction: e4m3 throughout

    def unit_roundoff(self, role: str) -> float:
        """The largest relative error of rounding one scaled operand (`input`, `weight` or
        `grad_output`) to its float8 format: 2^-(mantissa bits + 1), e4m3 2^-4, e5m2 2^-3."""
        dtype = getattr(_config(self), f"cast_config_{role}").target_dtype
        return torch.finfo(dtype).eps / 2


@lru_cache(maxsize=None)
def _ao():
    # torchao's import logs warnings that say nothing about this run (its CUDA-only extensions absent
    # from a CPU machine, a deprecated registration in torch's pytree) on every rank's stderr
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8 import config, float8_scaling_utils, float8_training_tensor
    except ImportError as e:  # the one clear line, before anything runs
        raise GridError("float8 precision needs torchao (pip install torchao)") from e
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return config, float8_scaling_utils, float8_training_tensor


def emulated(device: torch.device) -> bool:
    """Whether float8 products on `device` are emulated: the operands cast, scaled and rounded
    exactly as float8's, then multiplied in fp32 (torchao's emulate). Where a device has no float8
    matrix units torch's _scaled_mm is a reference loop (on this CPU 933 ms for 512 x 256 x 256,
    against 0.73 ms for the same values in bf16): everywhere but on CUDA, and on meta tensors (the
    planner's recordings: the products counted as float8's, at the cluster's float8 rate)."""
    return torch.device(device).type not in ("cuda", "meta")


@lru_cache(maxsize=None)
def _config(recipe: Float8Recipe, emulate: bool = False):
    import dataclasses

    config = _ao()[0]
    return dataclasses.replace(config.Float8LinearConfig.from_recipe_name(recipe.value), emulate=emulate)


@lru_cache(maxsize=None)
def _mm_config(recipe: Float8Recipe, emulate: bool):
    """torchao's LinearMMConfig of the recipe: its three products' _scaled_mm settings."""
    tt = _ao()[2]
    c = _config(recipe, emulate)
    return tt.LinearMMConfig(*(tt.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                               for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))


def _cast(t: torch.Tensor, recipe: Float8Recipe, cast: str, role: str, dim: int):
    """t in float8 with its dynamic scale, as the recipe casts operand `cast` for its `role`; a
    rowwise scale runs along `dim` (the product's contraction)."""
    _, su, tt = _ao()
    c = _config(recipe)
    cc = getattr(c, f"cast_config_{cast}")
    return su.hp_tensor_to_float8_dynamic(
        t, cc.target_dtype, _mm_config(recipe, emulated(t.device)), gemm_input_role=tt.GemmInputRole[role.upper()],
        scaling_granularity=cc.scaling_granularity, axiswise_dim=su.get_maybe_axiswise_dim(dim, cc.scaling_granularity),
        round_scales_to_power_of_2=c.round_scales_to_power_of_2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _unrows(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """y (rows, n) in like's leading shape; a 2-D product stays itself, not a view of itself (a
    collective may then reduce it in place: Megatron's g)."""
    return y if like.dim() == 2 else y.view(*like.shape[:-1], y.shape[-1])


def output(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe | None, bias=None) -> torch.Tensor:
    """x @ weight^T (+ bias) in float8: x (..., in), weight (out, in); recipe None: F.linear itself
    (the layers' one call either way). The bias is added in x's precision."""
    if recipe is None:
        return torch.nn.functional.linear(x, weight, bias)
    y = _unrows(torch.mm(_cast(_rows(x), recipe, "input", "input", -1),
                         _cast(weight.t(), recipe, "weight", "weight", 0)), x)
    return y if bias is None else y + bias.to(y.dtype)


def grad_input(dy: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe | None) -> torch.Tensor:
    """dy @ weight in float8: dy (..., out), weight (out, in); recipe None: dy @ weight."""
    if recipe is None:
        return dy @ weight
    g = _cast(_rows(dy), recipe, "grad_output", "grad_output", -1)
    w = _cast(weight.t(), recipe, "weight_for_grad_input", "weight", -1)
    return _unrows(torch.mm(g, w.t()), dy)


def grad_weight(dy: torch.Tensor, x: torch.Tensor, recipe: Float8Recipe | None) -> torch.Tensor:
    """dy^T @ x in float8, over every token: dy (..., out), x (..., in) -> (out, in); recipe None:
    the same product in their dtype."""
    dy, x = _rows(dy), _rows(x)
    if recipe is None:
        return dy.t() @ x
    short = -dy.shape[0] % ALIGNMENT
    if short and not emulated(dy.device):  # _scaled_mm's contraction a multiple of 16: zero tokens add nothing
        dy, x = torch.nn.functional.pad(dy, (0, 0, 0, short)), torch.nn.functional.pad(x, (0, 0, 0, short))
    g = _cast(dy, recipe, "grad_output_for_grad_weight", "grad_output", 0)
    return torch.mm(g.t(), _cast(x, recipe, "input_for_grad_weight", "input", 0))


class Product(enum.Enum):
    """Which of a linear's three products a local matrix product is: its operands' float8 roles."""
    OUTPUT = "output"  # X W^T: a = X, b = W^T
    GRAD_INPUT = "grad_input"  # dY W: a = dY, b = W
    GRAD_WEIGHT = "grad_weight"  # X^T dY (W^T's gradient): a = X^T, b = dY


def matmul(a: torch.Tensor, b: torch.Tensor, recipe: Float8Recipe | None, product: Product) -> torch.Tensor:
    """a @ b (2-D) as `product` of a linear, its operands cast for their roles (recipe None: a @ b):
    for layers whose local blocks hold W^T (the 2-D and 3-D algorithms' B)."""
    if recipe is None:
        return a @ b
    if product is Product.OUTPUT:
        return output(a, b.t(), recipe)
    if product is Product.GRAD_INPUT:
        return grad_input(a, b, recipe)
    return grad_weight(b, a.t(), recipe).t()


class _Linear(torch.autograd.Function):
    """x @ w^T on 2-D x, its three products in float8."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        return output(x, weight, recipe)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = grad_input(dy, weight, ctx.recipe) if ctx.needs_input_grad[0] else None
        dw = grad_weight(dy, x, ctx.recipe) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           recipe: Float8Recipe | None) -> torch.Tensor:
    """F.linear with its three products in float8, forward and backward; the bias added in x's
    precision; recipe None: F.linear itself. Unlike F.linear's, the output of an N-D x is a view of
    the product's rows: a collective that reduces in place takes 2-D rows (RowParallelLinear does)."""
    if recipe is None:
        return torch.nn.functional.linear(x, weight, bias)
    y = _unrows(_Linear.apply(_rows(x), weight, recipe), x)
    return y if bias is None else y + bias.to(y.dtype)


def is_float8(t) -> bool:
    """Whether t is a float8 operand torchao made (its matrix products run as torch._scaled_mm);
    torchao not loaded, none is (and asking does not load it)."""
    tt = sys.modules.get("torchao.float8.float8_training_tensor")
    return tt is not None and isinstance(t, tt.Float8TrainingTensor)


def gather_dtype() -> torch.dtype:
    """The float8 format weights are all-gathered in (ZeRO-3): the tensorwise recipe's weights'."""
    return _config(Float8Recipe.TENSORWISE).cast_config_weight.target_dtype


def gather_scales(amax: torch.Tensor) -> torch.Tensor:
    """Each weight's scale from its absolute maximum over every shard (torchao's amax_to_scale)."""
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(amax, gather_dtype())


def to_float8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x scaled and rounded to the gathers' float8 format, saturated (torchao's to_fp8_saturated)."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(x.float() * scale, gather_dtype())


def gathered_weights(module: torch.nn.Module) -> list:
    """The weights ZeRO-3 may all-gather in float8 (torchao's float8 all-gather for FSDP2: tensorwise
    scaling, one scale a weight): those of the linears whose products run in the tensorwise recipe.
    A rowwise recipe's scales are the rows' of each product, not one a weight: gathered as they are."""
    return [m.weight for m in module.modules()
            if getattr(m, "FLOAT8_GATHER", False) and m.float8 is Float8Recipe.TENSORWISE]


def check_device(device: torch.device) -> None:
    """One clear error, before anything runs, where float8 products cannot run: without torchao, or
    on a GPU without float8 tensor cores (compute capability below 8.9: Ada, Hopper and later have
    them). The CPU runs them (torch._scaled_mm), slowly: what the tests check numerics on."""
    _ao()
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise GridError(f"float8 was asked for but {torch.cuda.get_device_name(device)} cannot compute it (needs "
                        "compute capability 8.9 or newer: Ada, Hopper); use precision=bf16")


def check_sizes(what: str, *sizes: int) -> None:
    """One clear error where a float8 product's dimension is not a multiple of ALIGNMENT."""
    bad = [n for n in sizes if n % ALIGNMENT]
    if bad:
        raise GridError(f"{what}: float8 products need every dimension a multiple of {ALIGNMENT}, got "
                        f"{', '.join(map(str, sizes))}")


def convert(module: torch.nn.Module, recipe: Float8Recipe | None, keep=("head",)) -> int:
    """Runs the products of every parallel linear in `module` in float8 with `recipe` (None: back to
    the parameters' dtype), but those under a submodule named in `keep` (the vocabulary's head: its
    logits stay in bf16, as torchtitan keeps the output layer); every linear is checked first, so a
    layer float8 cannot take is one clear error before any is changed. Returns how many it set."""
    chosen = [(name, m) for name, m in module.named_modules() if hasattr(m, "FLOAT8")
              and not set(name.split(".")) & set(keep)]
    if recipe is not None:
        for name, m in chosen:
            if not m.FLOAT8:
                raise GridError(f"{name or type(m).__name__}: float8 products are not in {type(m).__name__} yet "
                                "(the linears of 1-D, 2-D and 3-D tensor parallelism, the replicated linears of the data, "
                                "sequence and sub-graph modes, and the experts of a mixture have them)")
            dims = tuple(m.float8_dims()) if hasattr(m, "float8_dims") else tuple(m.weight.shape)
            check_sizes(f"{name} ({type(m).__name__}, this rank's products' dimensions {dims})", *dims)
    for _, m in chosen:
        m.float8 = recipe
    return len(chosen)
