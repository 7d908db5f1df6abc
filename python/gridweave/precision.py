"""Mixed precision as the papers trained: bf16, and fp16 with dynamic loss scaling (AxoNN
§V: fp32 master weights and optimizer states, the loss scaled up so fp16 gradients do not
underflow; on an inf or NaN anywhere the step is skipped and the scale halved; after
`growth_interval` clean steps it doubles)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import float8
from .errors import GridError
from .float8 import Float8Recipe


@dataclass(frozen=True)
class Precision:
    """The model's compute dtype, and whether its gradients need loss scaling."""
    name: str
    dtype: torch.dtype
    loss_scaling: bool
    # the linear layers' products in float8 with this recipe, the rest in dtype (None: none)
    float8: Float8Recipe | None = None

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
        if self.float8 is not None:
            float8.check_device(device)


PRECISIONS = {"fp32": Precision("fp32", torch.float32, False),
              "bf16": Precision("bf16", torch.bfloat16, False),
              "fp16": Precision("fp16", torch.float16, True),
              # the linear layers' products in float8 (torchao's recipes), bf16 elsewhere
              "fp8": Precision("fp8", torch.bfloat16, False, Float8Recipe.TENSORWISE),
              "fp8-rowwise": Precision("fp8-rowwise", torch.bfloat16, False, Float8Recipe.ROWWISE),
              # float64 throughout: what gridweave verify compares against one process (to 1e-9)
              "fp64": Precision("fp64", torch.float64, False)}


class LossScaler:
    """Dynamic loss scaling, decided on the device (torch's GradScaler: the scale and its growth
    counter are tensors moved by `torch._amp_update_scale_`, so a step reads nothing on the host).
    scale(loss) before backward; after the gradients are summed, update(found_inf) skips or takes
    the step and moves the scale. The decision is global: every rank passes the same found_inf
    (the optimizers reduce it with Grid.any), so every rank skips the same steps. The tensors live
    on `device`, or on the device of the first loss scaled."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, device=None):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise GridError("LossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                            "growth_interval >= 1")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self._start = (float(init_scale), 0)  # (scale, clean steps) until the tensors exist
        self._scale = self._clean = self.last_used = None
        if device is not None:
            self._tensors(torch.device(device))

    def _tensors(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:  # float32 and int32: what torch._amp_update_scale_ takes
            self._scale = torch.full((), self._start[0], dtype=torch.float32, device=device)
            self._clean = torch.full((), self._start[1], dtype=torch.int32, device=device)
            self.last_used = self._scale.clone()
        return self._scale

    @property
    def tensor(self) -> torch.Tensor:
        """The scale the next loss is multiplied by, a 0-d float32 tensor on the device."""
        if self._scale is None:
            raise GridError("LossScaler has no device yet: pass device= or scale a loss first")
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._tensors(loss.device)

    def inverse(self) -> torch.Tensor:
        """1 / the scale this step's loss was multiplied by (before update moves it), on the device."""
        return self.tensor.reciprocal()

    def update(self, found_inf, step=None) -> torch.Tensor:
        """Move the scale: halve it (not below min_scale) where found_inf (a bool, or a tensor on the
        device, nonzero: an inf or NaN somewhere), double it after growth_interval clean steps.
        Returns whether the step may be taken, a bool tensor on the device, unread. `step` is
        accepted for old callers and unused."""
        scale = self.tensor
        found = torch.as_tensor(found_inf, device=scale.device).to(torch.float32).reshape(())
        self.last_used = scale.clone()  # what the step's loss was scaled by: the divergence guard's floor
        torch._amp_update_scale_(scale, self._clean, found, self.growth_factor, self.backoff_factor,
                                 self.growth_interval)
        scale.clamp_(min=self.min_scale)
        return found == 0

    @property
    def scale_value(self) -> float:
        """The scale, read on the host (logs, checkpoints, tests: not a training step's path)."""
        return float(self._scale) if self._scale is not None else self._start[0]

    @property
    def clean_steps(self) -> int:
        return int(self._clean) if self._clean is not None else self._start[1]

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        # clean steps since the last growth (an older state counted every clean step since the last skip)
        scale, clean = float(state["scale"]), int(state["clean_steps"]) % self.growth_interval
        if self._scale is None:
            self._start = (scale, clean)
        else:
            self._scale.fill_(scale)
            self._clean.fill_(clean)
