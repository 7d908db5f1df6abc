"""Mixed precision as the seeds trained: bf16, and fp16 with dynamic loss scaling (seed 001
§V: fp32 master weights and optimizer states, the loss scaled up so fp16 gradients do not
underflow; on an inf or NaN anywhere the step is skipped and the scale halved; after
`growth_interval` clean steps it doubles)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import GridError


@dataclass(frozen=True)
class Precision:
    """The model's compute dtype, and whether its gradients need loss scaling."""
    name: str
    dtype: torch.dtype
    loss_scaling: bool

    @classmethod
    def parse(cls, name: str) -> "Precision":
        try:
            return PRECISIONS[name]
        except KeyError:
            raise GridError(f"precision must be one of {sorted(PRECISIONS)}, got {name!r}") from None

    def check_device(self, device: torch.device) -> None:
        """One clear error, before any communication, where the device cannot compute it."""
        if self.dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise GridError(f"bf16 was asked for but {torch.cuda.get_device_name(device)} cannot compute it "
                            "(needs compute capability 8.0 or newer); use precision=fp16 or fp32")


PRECISIONS = {"fp32": Precision("fp32", torch.float32, False),
              "bf16": Precision("bf16", torch.bfloat16, False),
              "fp16": Precision("fp16", torch.float16, True)}


class LossScaler:
    """Dynamic loss scaling. scale(loss) before backward; after the gradients are summed,
    update(found_inf) says whether the step may be taken (False: skip it) and moves the
    scale. The decision is global: every rank passes the same found_inf (OffloadAdam
    all-reduces it), so every rank skips the same steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise GridError("LossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                            "growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.clean_steps = 0
        self.skipped = []  # optimizer steps (1-based) that were skipped

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def update(self, found_inf: bool, step: int) -> bool:
        """Take the step (True) or skip it (False), and move the scale."""
        if found_inf:
            self.skipped.append(step)
            self.scale_value = max(self.min_scale, self.scale_value * self.backoff_factor)
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale_value *= self.growth_factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
