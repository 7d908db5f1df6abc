"""Torch tensors, numpy and cupy arrays -> the engine's raw BufferView."""
from __future__ import annotations

import numpy as np
import torch

from . import _C
from .errors import GridError

# gridweave::DType, Device and ReduceOp (cpp/dtype.h), as the engine's enums.
_D = _C.DType
_TORCH = {torch.float32: _D.Float32, torch.float64: _D.Float64, torch.float16: _D.Float16,
          torch.bfloat16: _D.BFloat16, torch.int32: _D.Int32, torch.int64: _D.Int64, torch.uint8: _D.UInt8,
          # float8's bytes, moved whole (gathered, sent), never reduced: the engine's UInt8
          torch.float8_e4m3fn: _D.UInt8, torch.float8_e5m2: _D.UInt8}
_NUMPY = {np.dtype("float32"): _D.Float32, np.dtype("float64"): _D.Float64, np.dtype("float16"): _D.Float16,
          np.dtype("int32"): _D.Int32, np.dtype("int64"): _D.Int64}
CPU, CUDA = _C.Device.CPU, _C.Device.CUDA
REDUCE_OPS = {"sum": _C.ReduceOp.Sum, "max": _C.ReduceOp.Max, "min": _C.ReduceOp.Min}


def engine_dtype(dtype):
    """The engine's DType of a torch dtype."""
    if dtype not in _TORCH:
        raise GridError(f"dtype {dtype} is not supported (float32/64, float16, bfloat16, int32/64; uint8 and float8 "
                        "moved, not reduced)")
    return _TORCH[dtype]


def reduce_code(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise GridError(f"unknown reduce op {op!r}; use one of {sorted(REDUCE_OPS)}") from None


def view(t, what: str = "tensor") -> "_C.BufferView":
    """A BufferView of a contiguous torch tensor, numpy array or cupy array."""
    if isinstance(t, torch.Tensor):
        dtype = _TORCH.get(t.dtype)
        contiguous = t.is_contiguous()
        if dtype is not None and contiguous and t.is_cpu:  # first: the hot path of every CPU op
            return _C.BufferView(t.data_ptr(), t.numel(), dtype, CPU)
        if dtype is None:
            raise GridError(f"{what}: dtype {t.dtype} is not supported (float32/64, float16, bfloat16, int32/64)")
        if not contiguous:
            raise GridError(f"{what}: tensor must be contiguous (call .contiguous())")
        if t.is_cuda:
            stream = torch.cuda.current_stream(t.device).cuda_stream
            return _C.BufferView(t.data_ptr(), t.numel(), dtype, CUDA, t.device.index, stream)
        raise GridError(f"{what}: device {t.device} is not supported")
    if isinstance(t, np.ndarray):
        if t.dtype not in _NUMPY:
            raise GridError(f"{what}: numpy dtype {t.dtype} is not supported")
        if not t.flags["C_CONTIGUOUS"]:
            raise GridError(f"{what}: array must be C-contiguous")
        return _C.BufferView(t.ctypes.data, t.size, _NUMPY[t.dtype], CPU)
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:  # cupy and friends
        dt = np.dtype(cai["typestr"])
        if dt not in _NUMPY:
            raise GridError(f"{what}: array dtype {dt} is not supported")
        if cai.get("strides") is not None:
            raise GridError(f"{what}: array must be C-contiguous")
        count = int(np.prod(cai["shape"]))
        stream = cai.get("stream") or 0
        dev = getattr(getattr(t, "device", None), "id", -1)
        return _C.BufferView(cai["data"][0], count, _NUMPY[dt], CUDA, dev, int(stream))
    raise GridError(f"{what}: expected a torch tensor, numpy array or cupy array, got {type(t).__name__}")


def host_args(a, b=None):
    """(pointer, count) of a, and of b when given, then their DType: the arguments of the
    one-call synchronous ops on host memory (Communicator.all_gather_host and its kin). None
    unless each is a contiguous CPU torch tensor of one supported dtype. Spelled out for one
    and two tensors, not looped: this runs on every op."""
    if not (isinstance(a, torch.Tensor) and a.is_cpu and a.is_contiguous()):
        return None
    code = _TORCH.get(a.dtype)
    if code is None:
        return None
    if b is None:
        return a.data_ptr(), a.numel(), code
    if not (isinstance(b, torch.Tensor) and b.is_cpu and b.is_contiguous() and b.dtype == a.dtype):
        return None
    return a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), code


def empty_like_shape(t, shape):
    """A new contiguous buffer of t's kind, dtype and device."""
    if isinstance(t, torch.Tensor):
        return torch.empty(shape, dtype=t.dtype, device=t.device)
    if isinstance(t, np.ndarray):
        return np.empty(shape, dtype=t.dtype)
    import cupy  # only reached for cupy arrays

    return cupy.empty(shape, dtype=t.dtype)
