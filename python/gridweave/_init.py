"""The weights' initial values, written nowhere on meta tensors (shapes without values: the
planner's recorded stages, the launcher's parameter count): torch's meta normal_ loads
torch._dynamo, 1.4 s of every process that builds a model on meta."""
from __future__ import annotations

import torch
from torch import nn


def normal_(t: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """torch.nn.init.normal_, a no-op on a meta tensor."""
    if t.device.type != "meta":
        nn.init.normal_(t, mean, std)
    return t


def embedding(num: int, dim: int, dtype=None, device=None) -> nn.Embedding:
    """nn.Embedding (its weight N(0, 1)), made without values on meta."""
    where = torch.device(device) if device is not None else torch.get_default_device()
    if where.type != "meta":
        return nn.Embedding(num, dim, dtype=dtype, device=device)
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, dtype=dtype, device=where))
