"""What every optimizer of the grid shares: AdamW's fused update (torch's kernel), the device
buffers a bucket runs through, the state kept on the device so that a step needs no host read,
and the protocol the trainer relies on (GridOptimizer)."""
from __future__ import annotations

import weakref

import torch
from torch.optim.adamw import adamw as fused_adamw

from ..errors import GridError


def matrices_only(p) -> bool:
    """Weight decay on matrices (linears, embeddings), not on norms and biases."""
    return p.dim() >= 2


def adamw_(w, m, v, g, lr, betas, eps, t, weight_decay=0.0, decayed=(), lo: int = 0, found_inf=None) -> None:
    """One AdamW step in place on flat weights w and states m, v from gradient g (torch.optim.AdamW's
    update, Loshchilov & Hutter 2019, Alg. 2). w holds positions [lo, lo + len(w)) of a flat buffer
    whose decayed elements are `decayed` ((a, b) ranges): the decoupled decay (w *= 1 - lr wd)
    there first, then torch's fused Adam kernel, one pass over the buffers where the element-wise
    form takes eight. t: this step's number, or a float32 tensor on w's device holding the steps
    taken before it (read there, not on the host); found_inf: a float tensor there, nonzero to
    leave w, m and v as they are (torch's GradScaler pattern: the skip decided on the device)."""
    factor, hi = 1 - lr * weight_decay, lo + w.numel()
    if found_inf is not None and factor != 1.0:  # no decay either on a skipped step
        factor = 1 - lr * weight_decay * (1 - found_inf.to(w.dtype))
    for a, b in decayed if weight_decay and lr else ():
        a, b = max(a, lo), min(b, hi)
        if a < b:
            w[a - lo:b - lo].mul_(factor)
    # torch's functional form counts this step itself (and takes it back where found_inf says skip)
    step = t.clone() if isinstance(t, torch.Tensor) else torch.tensor(float(t - 1), device=w.device)
    fused_adamw([w], [g], [m], [v], [], [step], fused=True, amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
                weight_decay=0.0, eps=eps, maximize=False, found_inf=found_inf)


def dp_mean_scale(grid, average_dp: bool = True) -> float:
    """What each gradient is multiplied by before its sum over dp: 1/dp, so the sum is the mean
    (torch DDP's and Megatron's convention: each rank's loss is the mean over its own shard)."""
    dp = grid.axes.get("dp", 1) if grid is not None else 1
    return 1.0 / dp if average_dp and dp > 1 else 1.0


def uses_distributed(zero: int, offload: bool) -> bool:
    """Which optimizer a job runs: ZeRO stages and on-device state take DistributedAdam; zero 0
    offloaded is AxoNN's OffloadAdam (the main job's default)."""
    return bool(zero) or not offload


def checked_state(owner: str, state_dict: dict, params, keys) -> tuple:
    """(the per-parameter entries in parameter order, the one param group, the step) of a torch-style
    optimizer state_dict of full tensors, every entry checked before the caller writes anything."""
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list) or len(groups) != 1:
        raise GridError(f"{owner}.load_state_dict: expected {{'state': {{...}}, 'param_groups': [one group]}}")
    if len(groups[0].get("params", ())) != len(params):
        raise GridError(f"{owner}.load_state_dict: the state has {len(groups[0].get('params', ()))} "
                        f"parameters, this optimizer {len(params)}")
    entries, steps = [], set()
    for i, p in enumerate(params):
        s = state.get(i, state.get(str(i)))
        if s is None or any(k not in s for k in keys):
            raise GridError(f"{owner}.load_state_dict: parameter {i} lacks {list(keys)}")
        for k in keys:
            if tuple(s[k].shape) != tuple(p.shape):
                raise GridError(f"{owner}.load_state_dict: {k} of parameter {i} has shape "
                                f"{tuple(s[k].shape)}, the parameter {tuple(p.shape)}")
        steps.add(int(float(s["step"])))
        entries.append(s)
    if len(steps) > 1:
        raise GridError(f"{owner}.load_state_dict: parameters at different steps {sorted(steps)}")
    return entries, groups[0], steps.pop() if steps else 0


def _grad_hooks(opt, params) -> list:
    """Post-accumulate hooks calling opt._grad_ready while the optimizer lives, removed when it
    goes. A hook holds the optimizer weakly: torch does not traverse the hooks of a tensor that
    C++ also holds (a parameter that is a view of a flat buffer), so a strong hook would make the
    cycle parameter -> hook -> optimizer -> parameter that gc never collects, and with it the
    grid, its communicators and their threads (seen: 200 threads a rank after 100 grids)."""
    ref = weakref.ref(opt)

    def ready(p):
        o = ref()
        if o is not None:
            o._grad_ready(p)

    handles = [p.register_post_accumulate_grad_hook(ready) for p in params]
    weakref.finalize(opt, lambda hs=tuple(handles): [h.remove() for h in hs])
    return handles


class _Staging:
    """AxoNN's device buckets (§V: 16 bsize: the weights, the two Adam states and the descaled
    gradient), as two slots of bsize/2 used in turn. A bucket's copies from and to the pinned host
    state run on a side stream, non-blocking, ordered by events: the next bucket's copy in is
    issued before this one's copy out, so it overlaps this bucket's update, and the host waits for
    none of them (wait() before the host reads the state; order() before the device reads it).
    Without CUDA the same order runs synchronously."""

    STATES = 3  # the weights and two Adam states: each copied in and out of a bucket, LINK_COPIES a step
    LINK_COPIES = 2 * STATES

    def __init__(self, bsize: int, dtype, device):
        self.size = max(1, -(-bsize // 2))
        self.slots = [{k: torch.empty(self.size, dtype=dtype, device=device) for k in "wmvg"} for _ in range(2)]
        cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.loaded = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.updated = [torch.cuda.Event() for _ in range(2)] if cuda else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def _copy_in(self, k, host, n) -> None:
        slot = self.slots[k]
        if self.stream is None:
            for name, h in zip("wmv", host):
                slot[name][:n].copy_(h)
            return
        with torch.cuda.stream(self.stream):  # after the slot's last copy out: the same stream
            for name, h in zip("wmv", host):
                slot[name][:n].copy_(h, non_blocking=True)
            self.loaded[k].record(self.stream)

    def run(self, buckets, update) -> None:
        """buckets: [(host (w, m, v) slices of the pinned state, the gradient's slice on the device,
        its scale)], each at most the slot size; update(w, m, v, g) runs on the current stream."""
        if buckets:
            self._copy_in(0, buckets[0][0], buckets[0][1].numel())
        for b, (host, grad, scale) in enumerate(buckets):
            k, n = b % 2, grad.numel()
            if b + 1 < len(buckets):  # prefetch: in flight while this bucket updates
                self._copy_in(1 - k, buckets[b + 1][0], buckets[b + 1][1].numel())
            w, m, v, g = (self.slots[k][name][:n] for name in "wmvg")
            if self.stream is not None:
                torch.cuda.current_stream().wait_event(self.loaded[k])
            g.copy_(grad)  # descale the half-precision gradient in fp32
            if isinstance(scale, torch.Tensor) or scale != 1.0:
                g.mul_(scale)
            update(w, m, v, g)
            if self.stream is None:
                for h, d in zip(host, (w, m, v)):
                    h.copy_(d)
                continue
            self.updated[k].record()
            self.stream.wait_event(self.updated[k])
            with torch.cuda.stream(self.stream):
                for h, d in zip(host, (w, m, v)):
                    h.copy_(d, non_blocking=True)

    def order(self) -> None:
        """The current stream waits for the copies out (before it reads the host state)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def wait(self) -> None:
        """The host waits for the copies out (before it reads or writes the host state)."""
        if self.stream is not None:
            self.stream.synchronize()


def _pinned(t):
    """t in page-locked memory where a GPU copies it (a non-blocking copy needs it)."""
    return t.pin_memory() if torch.cuda.is_available() else t


class GridOptimizer:
    """The protocol the trainer relies on (OffloadAdam, DistributedAdam; a new optimizer subclasses
    it): set `lr` before each step and `backwards_per_step` (the pipeline's micro-batches: backward
    passes that accumulate one step's gradients) and `phases` (a gw.measure.StepPhases timing the
    reduction's waits, or None); `zero_grad()`; `step(scaler=None, skip=None)` sums, checks, clips
    and updates and returns whether the step was taken as a bool tensor on the device (skip: a bool
    tensor there, true to leave the weights as they are; scaler: fp16's LossScaler);
    `comm_lines()` the lines its steps reduce over (Grid.connect items); `device_bytes()`;
    `state_dict()` / `load_state_dict()`. What it keeps on the device so that a step's decisions
    need no host read: the steps taken (the fused kernel's bias correction reads it there; a skipped
    step leaves it) and the last clipped step's gradient norm."""

    lr: float
    backwards_per_step: int = 1
    phases = None

    def step(self, scaler=None, skip=None) -> torch.Tensor:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def comm_lines(self) -> list:
        raise NotImplementedError

    def device_bytes(self) -> dict:
        raise NotImplementedError

    def _init_steps(self, device) -> None:
        self._steps = torch.zeros((), dtype=torch.float32, device=device)
        self._norm = None

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (a host read of the device's count)."""
        return int(self._steps.item())

    @step_count.setter
    def step_count(self, n: int) -> None:
        self._steps.fill_(float(n))

    @property
    def grad_norm_tensor(self):
        """The last step's gradient norm (float64, on the device; None without clipping), unread."""
        return self._norm

    @property
    def last_grad_norm(self):
        """The last step's gradient norm as a number (a host read), or None without clipping."""
        return None if self._norm is None else float(self._norm)

    def _host_state(self) -> None:
        """Before the host reads or writes the state: the buckets' copies out are done."""
        if getattr(self, "_staging", None) is not None:
            self._staging.wait()

    def _clip(self, norm, unscale=1.0):
        """max_norm / (norm + 1e-6), at most 1 (torch's rule), times unscale, as a tensor on the
        device; the norm (already unscaled) is kept there."""
        self._norm = norm
        return (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0) * unscale  # float64: as a Python number was

    def _or_norm_not_finite(self, bad):
        """The skip flag, also set where the last clip's norm is not finite (every rank alike: the norm is global)."""
        norm_bad = ~torch.isfinite(self._norm)
        return norm_bad if bad is None else bad | norm_bad

    def _unscale(self, scaler, grads, skip) -> tuple:
        """fp16 (torch's GradScaler, on the device): an inf or NaN in any of the summed `grads` on any
        rank, or `skip`, skips the step on every rank; the scale moves. Returns (1 / the scale the
        loss was multiplied by, the skip flag), both tensors on the device, unread."""
        found = torch.stack([~torch.isfinite(g).all() for g in grads]).any()
        if skip is not None:
            found = found | skip.to(found.device)
        if getattr(self, "grid", None) is not None:
            found = self.grid.any(found)  # one decision on every rank
        inverse = scaler.inverse()  # before update moves the scale
        scaler.update(found)
        return inverse, found

    def _taken(self, bad, found_inf) -> torch.Tensor:
        """After the update: the step counted where it was taken; whether it was, on the device."""
        self._steps.add_(1.0 if found_inf is None else 1.0 - found_inf)
        return ~bad if bad is not None else torch.ones((), dtype=torch.bool, device=self._steps.device)


_DeviceSteps = GridOptimizer  # the older name


def held_bytes(params, optimizer) -> dict:
    """The bytes of parameters, gradients and optimizer state this rank holds, each storage once
    (host and device alike): the ZeRO paper's accounting (Rajbhandari et al. 2020, Fig. 1: 2Ψ + 2Ψ
    + KΨ with mixed precision, each term over N_d where its stage shards it). The optimizer's
    bucket and gather buffers, a constant, are counted apart."""
    seen = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            key = (str(t.device), st.data_ptr())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        return total

    return {"parameters": size(list(params) + list(getattr(optimizer, "param_shards", None) or [])),
            "gradients": size([p.grad for p in params] + list(getattr(optimizer, "grad_shards", None) or [])),
            "optimizer": size([getattr(optimizer, k) for k in optimizer.STATE_KEYS]),
            "optimizer_buffers": size([t for slot in getattr(getattr(optimizer, "_staging", None), "slots", [])
                                       for t in slot.values()])}
