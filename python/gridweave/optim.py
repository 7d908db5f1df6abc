"""Seed 001 §V: the bucketed, offloaded mixed-precision optimizer, and the gradient
all-reduce in chunks of k x bsize overlapped with it."""
from __future__ import annotations

import math

import torch

from .errors import GridError
from .sharding import grad_norm_of, placement_of


def matrices_only(p) -> bool:
    """Weight decay on matrices (linears, embeddings), not on norms and biases."""
    return p.dim() >= 2


def gradient_chunks(params, grid, bsize: int, coarsening: int) -> tuple:
    """OffloadAdam's flat layout and its gradient all-reduces (the planner costs the same ones):
    the parameters grouped by the axes their gradients are summed over (gw.reduce_gradients'
    rule), so that each chunk's all-reduce has one set of axes. Returns (order, offset of each
    parameter, chunks (lo, hi, axes)), a chunk being k x bsize elements (seed 001 §V-B)."""
    axes_of = [placement_of(p).reduce_axes(grid) if grid is not None else () for p in params]
    groups = list(dict.fromkeys(axes_of))
    order = sorted(range(len(params)), key=lambda i: groups.index(axes_of[i]))
    offset, off, chunks = {}, 0, []
    for axes in groups:
        lo = off
        for i in order:
            if axes_of[i] == axes:
                offset[i] = off
                off += params[i].numel()
        step = coarsening * bsize
        chunks += [(a, min(a + step, off), axes) for a in range(lo, off, step)]
    return order, offset, chunks


class OffloadAdam:
    """AdamW with fp32 master weights and Adam states in host memory, updated `bsize`
    elements at a time; the model keeps its own (fp16/bf16/fp32) weights and gradients.

    With a grid, step() first sums every gradient over its placement's partial axes
    (gw.reduce_gradients' rule), in chunks of k x bsize: each chunk's all-reduce is started
    asynchronously, and while the next one travels the optimizer updates the buckets of the
    chunk that has arrived. Gradients are divided by the data-parallel size before that sum
    (average_dp, the convention of torch DDP and Megatron: each rank's loss is the mean over
    its own shard), so half-precision sums do not overflow. With max_grad_norm, the global
    norm (every element once) is taken after the sum and the update is scaled as
    torch.nn.utils.clip_grad_norm_ would; the reduction then finishes before any update.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bsize=1 << 20,
                 grid=None, coarsening=4, average_dp=True, max_grad_norm=None, decay=None):
        """decay(p) -> bool: whether weight decay applies to p (default: every parameter;
        gw.optim.matrices_only leaves norms and biases undecayed, as Megatron and nanoGPT)."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise GridError("OffloadAdam got no parameters")
        if bsize < 1 or coarsening < 1:
            raise GridError("bsize and coarsening must be >= 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.bsize, self.k, self.grid = int(bsize), int(coarsening), grid
        self.average_dp, self.max_grad_norm = average_dp, max_grad_norm
        self.numel = sum(p.numel() for p in self.params)
        self._order, self._offset, self._chunks = gradient_chunks(self.params, grid, self.bsize, self.k)
        host = torch.device("cpu")
        pin = torch.cuda.is_available()
        flat = torch.empty(self.numel, dtype=torch.float32, device=host)
        for i, p in enumerate(self.params):
            flat[self._offset[i]:self._offset[i] + p.numel()] = p.detach().reshape(-1).to(host, torch.float32)
        self.master = flat.pin_memory() if pin else flat
        self._decay = None  # a 0/1 mask over the flat buffer, when some parameters are not decayed
        if decay is not None and not all(decay(p) for p in self.params):
            self._decay = torch.zeros(self.numel, dtype=torch.float32, device=host)
            for i, p in enumerate(self.params):
                if decay(p):
                    self._decay[self._offset[i]:self._offset[i] + p.numel()] = 1.0
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        dev = self.params[0].device
        # Device buffers reused across buckets: weights, two states, descaled gradients.
        kinds = ("w", "m", "v", "g") + (("d",) if self._decay is not None else ())
        self._buf = {k: torch.empty(self.bsize, dtype=torch.float32, device=dev) for k in kinds}

    # ---- memory accounting (bytes on the device) ------------------------------------
    def device_bytes(self) -> dict:
        """Parameters + gradients in the model's dtype and the 16*bsize of bucket buffers
        (4 phi + 16 bsize with half-precision models, seed 001 §V; 20*bsize when some
        parameters are not decayed: the decay mask's bucket); `without_offload` is the usual
        20 phi (half weights and gradients, fp32 master, fp32 gradients, two states)."""
        model = sum(p.numel() * p.element_size() for p in self.params)
        buckets = sum(b.numel() * b.element_size() for b in self._buf.values())
        return {"parameters_and_gradients": 2 * model, "buckets": buckets,
                "total": 2 * model + buckets, "without_offload": 20 * self.numel}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def _flat_grads(self):
        grads = [None] * len(self.params)
        for i in self._order:
            p = self.params[i]
            grads[i] = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        return torch.cat([grads[i] for i in self._order]).contiguous()

    def _dp_scale(self) -> float:
        g = self.grid
        return 1.0 / g.axes["dp"] if self.average_dp and g is not None and g.axes.get("dp", 1) > 1 else 1.0

    def step(self, scaler=None) -> bool:
        """Sum, (check, clip,) update. scaler: a gw.precision.LossScaler whose scale the loss
        was multiplied by: the gradients are unscaled in fp32 inside the update, and if any
        rank holds an inf or NaN after the sum, every rank skips the step and the scale
        backs off. With max_grad_norm, a non-finite norm (the same on every rank) skips the
        step too. Returns whether the step was taken."""
        grads = self._flat_grads()
        scale = self._dp_scale()
        if scale != 1.0:
            grads.mul_(scale)  # pre-divided: the sum over dp is then the mean, and fp16 cannot overflow there
        chunks = self._chunks
        work = {}

        def launch(i):
            if i < len(chunks) and chunks[i][2]:
                lo, hi, axes = chunks[i]
                work[i] = self.grid.all_reduce(grads[lo:hi], axis=axes, async_op=True)

        coef = 1.0
        whole = scaler is not None or self.max_grad_norm is not None
        if whole:  # the inf check and the norm need every sum first
            for i in range(len(chunks)):
                launch(i)
            for w in work.values():
                w.wait()
            work.clear()
            if scaler is not None:
                found = not bool(torch.isfinite(grads).all())
                if self.grid is not None:
                    found = self.grid.any(found)  # one decision on every rank
                used = scaler.scale_value  # the loss was scaled by this; update() may grow it
                if not scaler.update(found, self.step_count + 1):
                    return False
                coef = 1.0 / used
            if self.max_grad_norm is not None:
                coef *= self._clip_coefficient(grads, coef)
                if not math.isfinite(self.last_grad_norm):
                    return False  # the norm is global: every rank skips this step
        else:
            launch(0)
        self.step_count += 1
        for i, (lo, hi, _) in enumerate(chunks):
            if not whole:
                launch(i + 1)  # the next chunk travels while this one is optimized
            if i in work:
                work.pop(i).wait()
            for b in range(lo, hi, self.bsize):
                self._bucket(grads, b, min(b + self.bsize, hi), coef)
        self._write_back()
        return True

    def _clip_coefficient(self, grads, unscale: float = 1.0) -> float:
        """max_norm / (norm + 1e-6), at most 1, of the unscaled summed gradient (torch's rule)."""
        pieces = [(grads[self._offset[i]:self._offset[i] + p.numel()], placement_of(p))
                  for i, p in enumerate(self.params)]
        if self.grid is None:
            total = float(torch.linalg.vector_norm(grads.double()))
        else:
            total = float(grad_norm_of(pieces, self.grid))
        total *= unscale
        self.last_grad_norm = total
        return min(1.0, self.max_grad_norm / (total + 1e-6))

    def _bucket(self, grads, lo, hi, scale):
        n = hi - lo
        w, m, v, g = (self._buf[k][:n] for k in ("w", "m", "v", "g"))
        w.copy_(self.master[lo:hi])
        m.copy_(self.exp_avg[lo:hi])
        v.copy_(self.exp_avg_sq[lo:hi])
        g.copy_(grads[lo:hi])  # descale the half-precision gradient in fp32
        if scale != 1.0:
            g.mul_(scale)
        b1, b2 = self.betas
        t = self.step_count
        if self._decay is None:
            w.mul_(1 - self.lr * self.weight_decay)  # as torch.optim.AdamW
        else:
            d = self._buf["d"][:n]
            d.copy_(self._decay[lo:hi])
            w.sub_(w * d, alpha=self.lr * self.weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = self.lr / (1 - b1 ** t)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(self.eps)
        w.addcdiv_(m, denom, value=-step_size)
        self.master[lo:hi].copy_(w)
        self.exp_avg[lo:hi].copy_(m)
        self.exp_avg_sq[lo:hi].copy_(v)

    def _write_back(self):
        with torch.no_grad():
            for i, p in enumerate(self.params):
                o = self._offset[i]
                p.copy_(self.master[o:o + p.numel()].view_as(p).to(p.device, p.dtype))

    # ---- the torch.optim.Optimizer protocol -------------------------------------------
    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def _view(self, kind: str, i: int) -> torch.Tensor:
        p, o = self.params[i], self._offset[i]
        return getattr(self, kind)[o:o + p.numel()].view(p.shape)

    def state_dict(self) -> dict:
        """{"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]},
        indices in the order the parameters were given; the tensors are views of the host
        buffers (fp32), as torch optimizers return references to their state."""
        step = torch.tensor(float(self.step_count), device="cpu")
        state = {i: {"step": step, **{k: self._view(k, i) for k in self.STATE_KEYS}} for i in range(len(self.params))}
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "bsize": self.bsize, "coarsening": self.k, "max_grad_norm": self.max_grad_norm,
                 "params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state_dict's tensors into the host buffers and take its hyperparameters;
        every entry is checked before anything is written."""
        state, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not isinstance(state, dict) or not isinstance(groups, list) or len(groups) != 1:
            raise GridError("OffloadAdam.load_state_dict: expected {'state': {...}, 'param_groups': [one group]}")
        if len(groups[0].get("params", ())) != len(self.params):
            raise GridError(f"OffloadAdam.load_state_dict: the state has {len(groups[0].get('params', ()))} "
                            f"parameters, this optimizer {len(self.params)}")
        steps = set()
        for i, p in enumerate(self.params):
            s = state.get(i, state.get(str(i)))
            if s is None or any(k not in s for k in self.STATE_KEYS):
                raise GridError(f"OffloadAdam.load_state_dict: parameter {i} lacks {list(self.STATE_KEYS)}")
            for k in self.STATE_KEYS:
                if tuple(s[k].shape) != tuple(p.shape):
                    raise GridError(f"OffloadAdam.load_state_dict: {k} of parameter {i} has shape "
                                    f"{tuple(s[k].shape)}, the parameter {tuple(p.shape)}")
            steps.add(int(float(s["step"])))
        if len(steps) > 1:
            raise GridError(f"OffloadAdam.load_state_dict: parameters at different steps {sorted(steps)}")
        with torch.no_grad():
            for i in range(len(self.params)):
                s = state.get(i, state.get(str(i)))
                for k in self.STATE_KEYS:
                    self._view(k, i).copy_(s[k])
        g = groups[0]
        self.lr, self.betas, self.eps, self.weight_decay = g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]
        self.step_count = steps.pop() if steps else 0
