"""Seed 001 §V: the bucketed, offloaded mixed-precision optimizer, and the gradient
all-reduce in chunks of k x bsize overlapped with it."""
from __future__ import annotations

import contextlib
import enum
import weakref

import torch
from torch.optim.adamw import adamw as fused_adamw

from .checkpoint import FlatSlice
from .errors import GridError
from .measure import timed
from .grid import LinePart, Span
from .sharding import DATA_AXES, grad_norm_of, placement_of
from .zero import ParameterUnits


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


def gradient_chunks(params, grid, bsize: int, coarsening: int, backward: bool = False) -> tuple:
    """OffloadAdam's flat layout and its gradient all-reduces (the planner costs the same ones):
    the parameters grouped by the axes their gradients are summed over (gw.reduce_gradients'
    rule), so that each chunk's all-reduce has one set of axes. Returns (order, offset of each
    parameter, chunks (lo, hi, axes)), a chunk being k x bsize elements (seed 001 §V-B).
    backward: each group in the order the backward completes it (the last parameters first),
    so that overlapped chunks are ready in the order they start."""
    axes_of = [placement_of(p).reduce_axes(grid) if grid is not None else () for p in params]
    first = range(len(params) - 1, -1, -1) if backward else range(len(params))
    groups = list(dict.fromkeys(axes_of[i] for i in first))
    order = sorted(first, key=lambda i: groups.index(axes_of[i]))
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


def dp_mean_scale(grid, average_dp: bool = True) -> float:
    """What each gradient is multiplied by before its sum over dp: 1/dp, so the sum is the mean
    (torch DDP's and Megatron's convention: each rank's loss is the mean over its own shard)."""
    dp = grid.axes.get("dp", 1) if grid is not None else 1
    return 1.0 / dp if average_dp and dp > 1 else 1.0


def uses_distributed(zero: int, offload: bool) -> bool:
    """Which optimizer a job runs: ZeRO stages and on-device state take DistributedAdam; zero 0
    offloaded is seed 001's OffloadAdam (the main job's default)."""
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
    """Seed 001's device buckets (§V: 16 bsize: the weights, the two Adam states and the descaled
    gradient), as two slots of bsize/2 used in turn. A bucket's copies from and to the pinned host
    state run on a side stream, non-blocking, ordered by events: the next bucket's copy in is
    issued before this one's copy out, so it overlaps this bucket's update, and the host waits for
    none of them (wait() before the host reads the state; order() before the device reads it).
    Without CUDA the same order runs synchronously."""

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


class _DeviceSteps:
    """What both optimizers keep on the device so that a step's decisions need no host read: the
    steps taken (the fused kernel's bias correction reads it there; a skipped step leaves it) and
    the last clipped step's gradient norm."""

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


class OffloadAdam(_DeviceSteps):
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

    overlap: each chunk's all-reduce starts during the backward that completes its gradients (the
    last of `backwards_per_step` passes: the pipeline's micro-batches), chunks in one order on
    every rank (NCCL's rule), as torch DDP's buckets do; the gradient layout is then the backward's
    order. staged: the update goes through the bsize device buckets (seed 001, where the host
    memory holding the states is not the device's); default: only when it is not, since a model on
    the CPU would copy every element into a bucket and back for nothing. Unstaged, each chunk is
    updated in place in one pass over the flat buffers (the same arithmetic, bit for bit).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bsize=1 << 20,
                 grid=None, coarsening=4, average_dp=True, max_grad_norm=None, decay=None, overlap=False,
                 staged=None):
        """decay(p) -> bool: whether weight decay applies to p (default: every parameter;
        gw.optim.matrices_only leaves norms and biases undecayed, as Megatron and nanoGPT)."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise GridError("OffloadAdam got no parameters")
        if any(p.numel() and not p.untyped_storage().nbytes() for p in self.params):
            raise GridError("OffloadAdam all-reduces whole gradients of whole parameters; these are sharded by "
                            "ZeRO-3 (DistributedAdam zero=3, which offloads its shards with offload=True)")
        if bsize < 1 or coarsening < 1:
            raise GridError("bsize and coarsening must be >= 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.bsize, self.k, self.grid = int(bsize), int(coarsening), grid
        self.average_dp, self.max_grad_norm = average_dp, max_grad_norm
        self.numel = sum(p.numel() for p in self.params)
        self.overlap = bool(overlap) and grid is not None
        self._order, self._offset, self._chunks = gradient_chunks(self.params, grid, self.bsize, self.k,
                                                                  backward=self.overlap)
        host = torch.device("cpu")
        flat = torch.empty(self.numel, dtype=torch.float32, device=host)
        for i, p in enumerate(self.params):
            flat[self._offset[i]:self._offset[i] + p.numel()] = p.detach().reshape(-1).to(host, torch.float32)
        self.master = _pinned(flat)
        # the flat buffer's decayed elements, as ranges (each parameter's, the adjacent ones merged)
        self._decayed = []
        for i in sorted(range(len(self.params)), key=self._offset.__getitem__):
            if decay is None or decay(self.params[i]):
                a, b = self._offset[i], self._offset[i] + self.params[i].numel()
                if self._decayed and self._decayed[-1][1] == a:
                    a = self._decayed.pop()[0]
                self._decayed.append((a, b))
        self.exp_avg = _pinned(torch.zeros_like(self.master))  # *_like does not keep the pinning
        self.exp_avg_sq = _pinned(torch.zeros_like(self.master))
        dev = self.params[0].device
        self._init_steps(dev)
        self.staged = self.master.device != dev if staged is None else bool(staged)
        # Device buffers reused across buckets: weights, two states, descaled gradients (two slots).
        self._staging = _Staging(self.bsize, torch.float32, dev) if self.staged else None
        self.backwards_per_step = 1  # the pipeline's micro-batches: gw.train.train_step sets it
        self.phases = None  # a gw.measure.StepPhases timing the reduction's waits (gw.train.train_step sets it)
        self._grads = None  # the flat gradient the hooks fill (overlap)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # the chunks each parameter's elements fall in, and each chunk's parameter count
        self._chunks_of = [[c for c, (lo, hi, _) in enumerate(self._chunks)
                            if lo < self._offset[i] + p.numel() and self._offset[i] < hi]
                           for i, p in enumerate(self.params)]
        self._members = [sum(c in cs for cs in self._chunks_of) for c in range(len(self._chunks))]
        self._reset_reduction()
        self._hooks = _grad_hooks(self, self.params) if self.overlap else []

    # ---- memory accounting (bytes on the device) ------------------------------------
    def device_bytes(self) -> dict:
        """Parameters + gradients in the model's dtype and the 16*bsize of bucket buffers
        (4 phi + 16 bsize with half-precision models, seed 001 §V); `without_offload` is the usual
        20 phi (half weights and gradients, fp32 master, fp32 gradients, two states)."""
        model = sum(p.numel() * p.element_size() for p in self.params)
        buckets = self._staging.nbytes() if self._staging is not None else 0
        return {"parameters_and_gradients": 2 * model, "buckets": buckets,
                "total": 2 * model + buckets, "without_offload": 20 * self.numel}

    def comm_lines(self) -> list:
        """The lines its steps reduce over (Grid.connect items): each chunk's partial axes, and the
        world (the loss scaler's and the norm's decisions)."""
        grid = self.grid
        return [None] + [grid.reduce_line(axes) for _, _, axes in self._chunks if axes] if grid is not None else []

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for work in self._work.values():  # a step abandoned after its backward: finish what was sent
            work.wait()
        self._reset_reduction()

    def _reset_reduction(self):
        self._accumulated = [0] * len(self.params)
        self._copied = [False] * len(self.params)
        self._waiting = list(self._members)  # parameters whose gradient is not final yet, a chunk
        self._work: dict = {}  # chunk -> its all-reduce in flight
        self._next = 0  # the next chunk to start: in order on every rank

    def _copy_grad(self, i):
        """Parameter i's final gradient into the flat buffer (zeros without one), counted off its chunks."""
        p, o = self.params[i], self._offset[i]
        if self._grads is None:  # the model's dtype and device, made once
            self._grads = torch.empty(self.numel, dtype=p.dtype, device=p.device)
        dst = self._grads[o:o + p.numel()]
        if p.grad is not None:
            dst.copy_(p.grad.reshape(-1))
        else:
            dst.zero_()
        self._copied[i] = True
        for c in self._chunks_of[i]:
            self._waiting[c] -= 1

    def _grad_ready(self, p):
        """A parameter's gradient was accumulated: after its last backward of the step it joins the
        flat buffer, and every chunk now complete starts its all-reduce, in chunk order."""
        i = self._index[id(p)]
        self._accumulated[i] += 1
        if self._accumulated[i] > self.backwards_per_step:
            raise GridError(f"a parameter's gradient was accumulated {self._accumulated[i]} times in one step; "
                            f"OffloadAdam.backwards_per_step is {self.backwards_per_step} (set it to the "
                            "backward passes per step, or call zero_grad between steps)")
        if self._accumulated[i] < self.backwards_per_step:
            return
        self._copy_grad(i)
        self._start_ready()

    def _start_ready(self):
        while self._next < len(self._chunks) and self._waiting[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def _start(self, c):
        lo, hi, axes = self._chunks[c]
        scale = self._dp_scale()
        if scale != 1.0:  # pre-divided: the sum over dp is then the mean, and fp16 cannot overflow there
            self._grads[lo:hi].mul_(scale)
        if axes:
            self._work[c] = self.grid.all_reduce(self._grads[lo:hi], axis=axes, async_op=True)

    def _flat_grads(self):
        grads = [None] * len(self.params)
        for i in self._order:
            p = self.params[i]
            grads[i] = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        return torch.cat([grads[i] for i in self._order]).contiguous()

    def _dp_scale(self) -> float:
        return dp_mean_scale(self.grid, self.average_dp)

    def step(self, scaler=None, skip=None):
        """Sum, (check, clip,) update. skip: a bool tensor on the device, true to leave the weights as
        they are on every rank (the step's loss was not finite). Without a loss scaler every decision
        is the device's (a non-finite norm or skip masks the fused update: found_inf) and the return
        is a bool tensor there, whether the step was taken, unread. scaler: a gw.precision.LossScaler
        whose scale the loss was multiplied by (fp16): the gradients are unscaled in fp32 inside the
        update, and if any rank holds an inf or NaN after the sum, every rank skips the step and the
        scale backs off, decided on the device too."""
        chunks = self._chunks
        if self.overlap:  # what the backward did not start (parameters without a gradient), in order
            for i in range(len(self.params)):
                if not self._copied[i]:
                    self._copy_grad(i)
            self._start_ready()
            grads, work = self._grads, self._work
            launch = None
        else:
            grads = self._flat_grads()
            scale = self._dp_scale()
            if scale != 1.0:
                grads.mul_(scale)  # pre-divided: the sum over dp is then the mean, and fp16 cannot overflow there
            work = {}

            def launch(i):
                if i < len(chunks) and chunks[i][2]:
                    lo, hi, axes = chunks[i]
                    work[i] = self.grid.all_reduce(grads[lo:hi], axis=axes, async_op=True)

        coef, bad = 1.0, skip  # bad: the device's skip flag
        whole = scaler is not None or self.max_grad_norm is not None or self.overlap
        if whole:  # the inf check and the norm need every sum first (and overlap started them all)
            if launch is not None:
                for i in range(len(chunks)):
                    launch(i)
            for w in work.values():
                timed(self.phases, "reduction", w.wait)
            self._reset_reduction()
            work = {}
            if scaler is not None:
                coef, bad = self._unscale(scaler, [grads], skip)
            if self.max_grad_norm is not None:
                coef = self._clip_coefficient(grads, coef)
                bad = ~torch.isfinite(self._norm) if bad is None else bad | ~torch.isfinite(self._norm)
        else:
            launch(0)
        dev = self._steps.device
        found_inf = None if bad is None else bad.to(device=dev, dtype=torch.float32)
        if whole and not self.staged:  # every sum is here: one pass over the flat buffers
            self._update(grads, 0, self.numel, coef, found_inf)
        else:
            for i, (lo, hi, _) in enumerate(chunks):
                if not whole:
                    launch(i + 1)  # the next chunk travels while this one is optimized
                if i in work:
                    timed(self.phases, "reduction", work.pop(i).wait)
                if self.staged:
                    self._buckets(grads, lo, hi, coef, found_inf)
                else:
                    self._update(grads, lo, hi, coef, found_inf)
        taken = self._taken(bad, found_inf)
        self._write_back(None if bad is None else taken)
        return taken

    def _update(self, grads, lo, hi, scale, found_inf=None):
        """AdamW in place on the flat buffers' elements [lo, hi) (unstaged: they live on the device)."""
        g = grads[lo:hi]
        if g.dtype != torch.float32 or isinstance(scale, torch.Tensor) or scale != 1.0:
            g = g.to(torch.float32) * scale  # descale the half-precision gradient in fp32
        adamw_(self.master[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], g, self.lr, self.betas, self.eps,
               self._steps, self.weight_decay, self._decayed, lo, found_inf)

    def _clip_coefficient(self, grads, unscale: float = 1.0):
        """max_norm / (norm + 1e-6), at most 1, of the unscaled summed gradient (torch's rule), as a
        tensor on the device, times unscale; the norm is kept there (self._norm)."""
        if self.grid is None:
            total = torch.linalg.vector_norm(grads, dtype=torch.float64)
        else:  # each parameter counted once over the grid (its placement)
            total = grad_norm_of([(grads[self._offset[i]:self._offset[i] + p.numel()], placement_of(p))
                                  for i, p in enumerate(self.params)], self.grid)
        return self._clip(total * unscale, unscale)

    def _buckets(self, grads, lo, hi, scale, found_inf=None):
        """Elements [lo, hi) updated through the device buckets (_Staging)."""
        size = self._staging.size
        starts = range(lo, hi, size)
        buckets = [((self.master[b:min(b + size, hi)], self.exp_avg[b:min(b + size, hi)],
                     self.exp_avg_sq[b:min(b + size, hi)]), grads[b:min(b + size, hi)], scale) for b in starts]

        def update(w, m, v, g, at=iter(starts)):
            adamw_(w, m, v, g, self.lr, self.betas, self.eps, self._steps, self.weight_decay, self._decayed, next(at),
                   found_inf)
        self._staging.run(buckets, update)

    def _write_back(self, taken=None):
        """The parameters from the master; where `taken` (a device flag) says the step was skipped,
        they stay as they are (a skipped step changes nothing, a corrupted weight included)."""
        if self._staging is not None:
            self._staging.order()  # the parameters are copied from the host state the buckets wrote
        with torch.no_grad():
            for i, p in enumerate(self.params):
                o = self._offset[i]
                new = self.master[o:o + p.numel()].view_as(p).to(p.device, p.dtype, non_blocking=True)
                p.copy_(new if taken is None else torch.where(taken, new, p))

    # ---- the torch.optim.Optimizer protocol -------------------------------------------
    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def _view(self, kind: str, i: int) -> torch.Tensor:
        p, o = self.params[i], self._offset[i]
        return getattr(self, kind)[o:o + p.numel()].view(p.shape)

    def state_dict(self) -> dict:
        """{"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]},
        indices in the order the parameters were given; the tensors are views of the host
        buffers (fp32), as torch optimizers return references to their state."""
        self._host_state()  # the buckets' copies out are done
        step = torch.tensor(float(self.step_count), device="cpu")
        state = {i: {"step": step, **{k: self._view(k, i) for k in self.STATE_KEYS}} for i in range(len(self.params))}
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "bsize": self.bsize, "coarsening": self.k, "max_grad_norm": self.max_grad_norm,
                 "params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

    def whole_parameters(self, writeback: bool = False):
        """DistributedAdam's protocol: the parameters are always whole here."""
        return contextlib.nullcontext()

    def checkpoint_tensors(self) -> dict:
        """{id(param): {kind: tensor}} for gw.checkpoint.save: the parameter and its three states."""
        self._host_state()  # the buckets' copies out are done
        return {id(p): {"param": p, **{k: self._view(k, i) for k in self.STATE_KEYS}}
                for i, p in enumerate(self.params)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state_dict's tensors into the host buffers and take its hyperparameters;
        every entry is checked before anything is written."""
        self._host_state()  # the buckets' copies out are done
        entries, g, step = checked_state("OffloadAdam", state_dict, self.params, self.STATE_KEYS)
        with torch.no_grad():
            for i, s in enumerate(entries):
                for k in self.STATE_KEYS:
                    self._view(k, i).copy_(s[k])
        self.lr, self.betas, self.eps, self.weight_decay = g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]
        self.step_count = step


class ShardGroup(enum.Enum):
    """Over which ranks of the data axes ZeRO shards."""
    ALL = "all"  # every rank of them
    NODE = "node"  # those on one node, replicated across nodes (hybrid sharding: torchtitan's HSDP)


# DistributedAdam's elements per reduce-scatter bucket (whole parameters)
BUCKET = 1 << 22


def bucket_starts(sizes: list, bucket: int, units: list | None = None) -> list:
    """Where DistributedAdam's buckets start among one reduction's parameters (their sizes, in
    backward order): a new bucket where the current one holds something and the next parameter
    would take it past `bucket` elements; with units (ZeRO-3), where the next parameter is
    another unit's. A pure function, so the planner can tell when a stage's layers cut alike."""
    starts, fill = ([0] if sizes else []), 0
    for i, n in enumerate(sizes):
        if i and (units[i] != units[i - 1] if units is not None else fill + n > bucket):
            starts.append(i)
            fill = 0
        fill += n
    return starts


class _Group:
    """The parameters whose gradients are summed over the same axes, laid out flat and padded
    so that the shard axes split them into equal shards: this rank's shard is [lo, hi) of the
    group's padded range [start, start + padded). data: the data axes it is sharded over
    (shard_axes: them, or hybrid sharding's node part of them, whose other part is `replica`)."""

    def __init__(self, members, axes, data, grid, start, buf_lo, hybrid=False):
        self.members, self.axes, self.data = members, axes, data  # members: [(index, param)]
        self.shard_axes = LinePart(data, Span.WITHIN) if hybrid and data else data
        across = LinePart(data, Span.ACROSS) if hybrid and data else None
        self.replica = across if across is not None and grid.size(across) > 1 else None
        self.rest = tuple(a for a in axes if a not in data)  # summed, not sharded (e.g. tensor axes)
        shard_axes = self.shard_axes
        n = grid.size(shard_axes) if shard_axes else 1
        self.numel = sum(p.numel() for _, p in members)
        self.padded = -(-self.numel // n) * n
        self.start, self.shard = start, self.padded // n
        self.lo = start + (grid.index(shard_axes) if shard_axes else 0) * self.shard
        self.hi = self.lo + self.shard
        self.buf_lo, self.buf_hi = buf_lo, buf_lo + self.shard  # its shard in the optimizer's state buffers

    def spans(self):
        """(index, param, start, end, offset) of every parameter overlapping this rank's shard:
        [start, end) in the shard, from element `offset` of the (flattened) parameter."""
        off = self.start
        for i, p in self.members:
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                yield i, p, a - self.lo, b - self.lo, a - off
            off += p.numel()


class DistributedAdam(_DeviceSteps):
    """ZeRO stages 1, 2 and 3 (Rajbhandari et al. 2020, §5.1-5.3; Megatron's distributed optimizer),
    and zero=0: every replica holds the whole state (all-reduced gradients, as torch DDP + AdamW):
    AdamW whose fp32 master weights and states are sharded over the data axes every gradient
    is partial over (dp, and sp where the sequence is split: torchtitan's dp_shard x cp).

    step(): the gradients are reduce-scattered over those axes (and all-reduced over any other
    partial axes, e.g. a 3-D mode's), each rank updates its shard (on the device, or in host
    memory in buckets of `bsize` with offload: ZeRO-Offload over seed 001's OffloadAdam), and the
    updated parameters are all-gathered in the model's dtype. zero=2 also frees the full
    gradients once reduced (only this rank's shard is kept). The loss scaler, global-norm
    clipping (the norm over the shards, each element once) and weight-decay masks work as in
    OffloadAdam, whose protocol this follows. zero=3 (§5.3) shards the parameters too: one bucket
    per unit (a module: gw.zero.ParameterUnits gathers it before its forward and its backward and
    frees it after), the step updates the shards and gathers nothing; whole_parameters() is the
    context for reading them whole outside forward and backward."""

    STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, params, grid, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, zero=1,
                 offload=False, bsize=1 << 20, average_dp=True, max_grad_norm=None, decay=None, bucket=None,
                 overlap=True, units=None, prefetch=True, shard_group=ShardGroup.ALL):
        """bucket: elements per reduce-scatter (whole parameters, in backward order; None: BUCKET); overlap: each
        bucket's reduction starts during the backward that completes its gradients (the last of
        `backwards_per_step` passes: the pipeline's micro-batches), in bucket order on every rank.
        units (zero=3): the modules whose parameters are gathered together, in forward order
        (e.g. GPTStage.shard_units()): each one a bucket; prefetch: the next unit's all-gather
        starts while this one computes. shard_group: ShardGroup.NODE shards within each node and
        keeps a replica per node (the gradient shards all-reduced across nodes)."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise GridError("DistributedAdam got no parameters")
        if not isinstance(shard_group, ShardGroup):
            raise GridError(f"shard_group must be a gw.optim.ShardGroup, got {shard_group!r}")
        if shard_group is ShardGroup.NODE and not zero:
            raise GridError("shard_group=NODE is hybrid sharding: it needs zero 1, 2 or 3")
        if zero not in (0, 1, 2, 3):
            raise GridError(f"DistributedAdam takes zero 0 (no sharding), 1, 2 or 3, got {zero!r}")
        if grid is None:
            raise GridError("DistributedAdam needs the grid its parameters live on")
        unit_of = {}
        if zero == 3:
            if units is None:
                raise GridError("zero=3 gathers the parameters one unit at a time: pass units, the modules in "
                                "forward order (e.g. GPTStage.shard_units())")
            units = list(units)
            for u, mod in enumerate(units):
                for p in mod.parameters():
                    unit_of.setdefault(id(p), u)
            outside = [i for i, p in enumerate(self.params) if id(p) not in unit_of]
            if outside:
                raise GridError(f"zero=3: parameters {outside} are in none of the units (every parameter is "
                                "gathered with a unit)")
        elif units is not None:
            raise GridError(f"units are zero=3's (the parameters gathered together); zero is {zero}")
        if zero and all(grid.axes.get(a, 1) == 1 for a in DATA_AXES):
            raise GridError(f"zero={zero} shards over the data axes (dp, sp); this grid has none of size > 1: "
                            f"{dict(grid.axes) if grid is not None else None}")
        bucket = BUCKET if bucket is None else bucket
        if bsize < 1 or bucket < 1:
            raise GridError(f"bsize and bucket must be >= 1, got {bsize!r}, {bucket!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise GridError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        self.grid, self.zero, self.offload, self.bsize = grid, zero, offload, int(bsize)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.average_dp, self.max_grad_norm = average_dp, max_grad_norm
        by_axes: dict = {}
        for i, p in enumerate(self.params):
            by_axes.setdefault(placement_of(p).reduce_axes(grid), []).append((i, p))
        parts = []  # (axes, members): a bucket, its members in backward order
        for axes, members in by_axes.items():
            members = members[::-1]  # backward order: the last parameters' gradients come first
            starts = bucket_starts([p.numel() for _, p in members], bucket,
                                   [unit_of[id(p)] for _, p in members] if zero == 3 else None)
            parts += [(axes, members[a:b]) for a, b in zip(starts, starts[1:] + [len(members)])]
        if zero == 3:  # a unit's buckets in the order its backward completes them: the last unit's first
            parts.sort(key=lambda ap: -unit_of[id(ap[1][0][1])])
        self.groups, start, shard_lo = [], 0, 0
        for axes, part in parts:
            g = _Group(part, axes, tuple(a for a in axes if a in DATA_AXES) if zero else (), grid, start, shard_lo,
                       hybrid=shard_group is ShardGroup.NODE)
            g.unit = unit_of.get(id(part[0][1]))
            self.groups.append(g)
            start, shard_lo = start + g.padded, g.buf_hi
        self.padded = start
        self._bucket_of = {id(p): k for k, g in enumerate(self.groups) for _, p in g.members}
        self.backwards_per_step = 1  # the pipeline's micro-batches: gw.train.train_step sets it
        self.phases = None  # a gw.measure.StepPhases timing the reduction (gw.train.train_step sets it)
        self._unit_of, self.overlap = unit_of, overlap
        self._reset_reduction()
        self._hooks = _grad_hooks(self, self.params) if overlap or zero == 3 else []
        dev, dtype = self.params[0].device, self.params[0].dtype
        if any(p.dtype != dtype or p.device != dev for p in self.params):
            raise GridError("DistributedAdam takes parameters of one dtype on one device (its all-gathers carry the "
                            f"model's dtype), got {sorted({(str(p.dtype), str(p.device)) for p in self.params})}")
        home = torch.device("cpu") if offload else dev
        self.dtype = torch.promote_types(dtype, torch.float32)  # fp32 masters of half-precision models
        self.master = torch.cat([self._gather_flat(g, lambda p: p.detach()).to(home, self.dtype)[g.lo - g.start:
                                                                                                 g.hi - g.start]
                                 for g in self.groups])
        if offload:
            self.master = _pinned(self.master)
        # each group's decayed stretches of its shard (no mask: the states stay 12 bytes an element)
        self._decayed = [[(a, b) for _, p, a, b, _ in g.spans() if decay is None or decay(p)] for g in self.groups]
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        if offload:  # *_like does not keep the pinning
            self.exp_avg, self.exp_avg_sq = _pinned(self.exp_avg), _pinned(self.exp_avg_sq)
        self.grad_shards = None  # zero=2: the reduced gradient shards the last step kept
        self._init_steps(grid.device)
        self._staging = _Staging(self.bsize, self.dtype, dev) if offload else None
        self.units = None
        if zero == 3:
            for g in self.groups:  # the parameter shard the all-gathers read: the master itself where it
                # has the model's dtype and device (no second copy), else a copy in the model's dtype
                g.param_shard = self.master[g.buf_lo:g.buf_hi].to(dev, dtype)
                g.aliased = bool(g.shard_axes) and g.param_shard.data_ptr() == self.master[g.buf_lo:].data_ptr()
            self.units = ParameterUnits(grid, units, self.groups, prefetch=prefetch)
            for g in self.groups:
                if not g.shard_axes:  # whole between uses: its parameters are the buffer
                    g.param_shard = g.full

    def _gather_flat(self, group, value):
        """The group's padded flat tensor of value(p) for its members (zeros in the padding)."""
        parts = [value(p).reshape(-1) for _, p in group.members]
        pad = group.padded - group.numel
        if pad:
            parts.append(torch.zeros(pad, dtype=parts[0].dtype, device=parts[0].device))
        return torch.cat(parts)

    def comm_lines(self) -> list:
        """The lines its steps and gathers use (Grid.connect items): every group's shard, summed and
        replica axes, and the world (the norm's and the skip decision's)."""
        items = [None]
        for g in self.groups:
            items += [a for a in (g.shard_axes, g.replica) if a]  # gathered, reduce-scattered and all-reduced
            items += [self.grid.reduce_line(a) for a in (g.axes, g.rest) if a]  # all-reduced
        return items

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        if self.units is not None:
            self.units.free_all()
        for work, _ in self._inflight.values():  # a step abandoned after its backward: finish what was sent
            if work is not None:
                work.wait()
        self._reset_reduction()

    def _reset_reduction(self):
        self._accumulated = {id(p): 0 for p in self.params}
        self._waiting = [len(g.members) for g in self.groups]  # parameters whose gradient is not final yet
        self._inflight: dict = {}  # bucket -> (work or None, its flat gradient / result)
        self._next = 0  # the next bucket to start: buckets start in order on every rank (NCCL's rule)

    def _grad_ready(self, p):
        """A parameter's gradient was accumulated: after its last backward of the step, its bucket
        may start (and every bucket before it that is complete); zero 3 frees a unit whose
        parameters all have their gradient of this backward."""
        key = id(p)
        if self.units is not None:
            self.units.accumulated(self._unit_of[key])
        if not self.overlap:
            return
        self._accumulated[key] += 1
        if self._accumulated[key] > self.backwards_per_step:
            raise GridError(f"a parameter's gradient was accumulated {self._accumulated[key]} times in one step; "
                            f"DistributedAdam.backwards_per_step is {self.backwards_per_step} (set it to the "
                            "backward passes per step, or call zero_grad between steps)")
        if self._accumulated[key] == self.backwards_per_step:
            self._waiting[self._bucket_of[key]] -= 1
            while self._next < len(self.groups) and self._waiting[self._next] == 0:
                self._launch(self._next)
                self._next += 1

    def _launch(self, k):
        """Bucket k's reduction, started: reduce-scatter over its shard axes (all-reduce when it has
        none); zero 2 drops the full gradients as soon as they are in the flat buffer."""
        g, scale = self.groups[k], self._dp_scale()
        flat = self._gather_flat(g, lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        if scale != 1.0:
            flat.mul_(scale)  # pre-divided: the sum over dp is then the mean (OffloadAdam's rule)
        if self.zero >= 2:
            for _, p in g.members:
                p.grad = None  # only the shards outlive the reduction (ZeRO-2)
        if g.shard_axes:
            work = self.grid.reduce_scatter(flat, axis=g.shard_axes, async_op=True)
        elif g.axes:
            work = self.grid.all_reduce(flat, axis=g.axes, async_op=True)
        else:
            work = None
        self._inflight[k] = (work, flat)

    @property
    def buckets_started(self) -> int:
        """Buckets whose reduction has started since the last step (the backward starts them)."""
        return self._next

    def _dp_scale(self) -> float:
        return dp_mean_scale(self.grid, self.average_dp)

    def reduce_gradients(self) -> list:
        """Each bucket's reduced gradient shard (the model's dtype): the buckets the backward did
        not start are started now, in order; then all of them are waited for, and all-reduced
        over their other partial axes (e.g. a 3-D mode's)."""
        while self._next < len(self.groups):
            self._launch(self._next)
            self._next += 1
        shards = []
        for k, g in enumerate(self.groups):
            work, flat = self._inflight[k]
            out = timed(self.phases, "reduction", work.wait) if work is not None else flat
            if g.shard_axes and g.rest:
                timed(self.phases, "reduction", self.grid.all_reduce, out, g.rest)
            if g.replica is not None:  # hybrid sharding: the node's shard summed over the other nodes
                timed(self.phases, "reduction", self.grid.all_reduce, out, g.replica)
            shards.append(out)
        self._reset_reduction()
        return shards

    def step(self, scaler=None, skip=None) -> torch.Tensor:
        """Reduce-scatter, (check, clip,) update the shard, all-gather. Returns whether the step
        was taken (a non-finite gradient or norm skips it on every rank, as OffloadAdam). skip: a bool
        tensor, true to skip the step (the loss was not finite); every decision is the device's, as
        OffloadAdam's, and the return a bool tensor there."""
        if self.units is not None:
            self.units.free_all()  # whatever a backward left gathered (a parameter without a gradient)
        shards = self.reduce_gradients()
        if self.zero >= 2:
            self.grad_shards = shards
        coef, bad = 1.0, skip  # bad: the device's skip flag
        if scaler is not None:
            coef, bad = self._unscale(scaler, shards, skip)
        if self.max_grad_norm is not None:
            coef = self._clip(grad_norm_of(self.norm_pieces(shards), self.grid) * coef, coef)
            bad = ~torch.isfinite(self._norm) if bad is None else bad | ~torch.isfinite(self._norm)
        found_inf = None if bad is None else bad.to(device=self._steps.device, dtype=torch.float32)
        for k, (g, s) in enumerate(zip(self.groups, shards)):
            lo, hi = g.buf_lo, g.buf_hi
            if self.offload:
                self._buckets(k, s, coef, found_inf)
            else:
                grad = s.to(self.dtype) if s.dtype != self.dtype else s.clone()
                if isinstance(coef, torch.Tensor) or coef != 1.0:
                    grad.mul_(coef)
                adamw_(self.master[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], grad, self.lr, self.betas,
                       self.eps, self._steps, self.weight_decay, self._decayed[k], found_inf=found_inf)
        taken = self._taken(bad, found_inf)
        if self._staging is not None:
            self._staging.order()  # the gathers read the host state the buckets wrote
        if self.units is not None:
            self._refresh_shards()  # the next forward gathers them
        else:
            self.gather_parameters(None if bad is None else taken)
        return taken

    def _refresh_shards(self) -> None:
        """ZeRO-3: each parameter shard the all-gathers read, from the updated master."""
        with torch.no_grad():
            for g in self.groups:
                if not g.aliased:
                    g.param_shard.copy_(self.master[g.buf_lo:g.buf_hi])

    def whole_parameters(self, writeback: bool = False):
        """A context in which every parameter is whole (zero 3 gathers them; the other stages hold
        them whole anyway): for code that reads or writes parameters outside forward and
        backward (checkpoints, export, evaluation by hand). writeback: what the block wrote into
        them becomes the shards and the fp32 master (collective over the data axes)."""
        self._host_state()  # the buckets' copies out are done
        if self.units is None:
            return contextlib.nullcontext()

        def write(g):
            if not g.aliased:
                self.master[g.buf_lo:g.buf_hi].copy_(g.param_shard)
        return self.units.whole(writeback, on_write=write)

    @property
    def param_shards(self) -> list:
        """ZeRO-3: the parameter shards this rank keeps between uses (the all-gathers' inputs)."""
        return [g.param_shard for g in self.groups] if self.units is not None else []

    def norm_pieces(self, shards) -> list:
        """(gradient slice, placement, shard axes) of every parameter slice in this rank's shards:
        grad_norm_of counts each element of the model once."""
        return [(s[a:b], placement_of(p), g.data) for g, s in zip(self.groups, shards) if self._counts(g)
                for _, p, a, b, _ in g.spans()]

    def _counts(self, g) -> bool:
        """Whether this rank's shard of group g is the copy that counts (hybrid sharding: the
        first node's; the other nodes hold the same shard)."""
        return g.replica is None or self.grid.index(g.replica) == 0

    def _buckets(self, k, shard, coef, found_inf=None):
        """Offload: group k's shard updated through the device buckets (_Staging)."""
        base, size, n = self.groups[k].buf_lo, self._staging.size, shard.numel()
        starts = range(0, n, size)
        buckets = [tuple(buf[base + b:base + min(b + size, n)] for buf in (self.master, self.exp_avg, self.exp_avg_sq))
                   for b in starts]
        buckets = [(host, shard[b:min(b + size, n)], coef) for host, b in zip(buckets, starts)]

        def update(w, m, v, g, at=iter(starts)):
            adamw_(w, m, v, g, self.lr, self.betas, self.eps, self._steps, self.weight_decay, self._decayed[k],
                   next(at), found_inf)
        self._staging.run(buckets, update)

    def gather_parameters(self, taken=None) -> None:
        """Every rank's updated shard, in the model's dtype, gathered into its parameters; where
        `taken` (a device flag) says the step was skipped, they stay as they are."""
        dev, dtype = self.params[0].device, self.params[0].dtype
        for g in self.groups:
            lo, hi = g.buf_lo, g.buf_hi
            mine = self.master[lo:hi].to(dev, dtype)
            full = self.grid.all_gather(mine, axis=g.shard_axes) if g.shard_axes else mine
            off = 0
            with torch.no_grad():
                for _, p in g.members:
                    new = full[off:off + p.numel()].view_as(p)
                    p.copy_(new if taken is None else torch.where(taken, new, p))
                    off += p.numel()

    # ---- the torch.optim.Optimizer protocol (full tensors per parameter, as OffloadAdam's) ----
    def _full(self, buf) -> list:
        """Per parameter, the full tensor of a sharded buffer (collective over each group's shard
        axes: every rank of them calls it), on the buffer's device."""
        self._host_state()  # the buckets' copies out are done
        out = [None] * len(self.params)
        dev = self.params[0].device
        for g in self.groups:
            lo, hi = g.buf_lo, g.buf_hi
            mine = buf[lo:hi].to(dev)
            full = (self.grid.all_gather(mine, axis=g.shard_axes) if g.shard_axes else mine).to(buf.device)
            off = 0
            for i, p in g.members:
                out[i] = full[off:off + p.numel()].view(p.shape)
                off += p.numel()
        return out

    def checkpoint_tensors(self) -> dict:
        """{id(param): {kind: value}} for gw.checkpoint.save: "param" (the parameter; at zero 3 the
        piece of it in this rank's shard) and the three states, as FlatSlices of this rank's shard:
        each rank writes what it holds, nothing is gathered."""
        self._host_state()  # the buckets' copies out are done
        out = {id(p): {} if self.units is not None else {"param": p} for p in self.params}
        for g in self.groups:
            for _, p, a, b, off in g.spans() if self._counts(g) else ():
                if self.units is not None:
                    out[id(p)]["param"] = FlatSlice(off, off + b - a, g.param_shard[a:b], g.data)
                for k in self.STATE_KEYS:
                    out[id(p)][k] = FlatSlice(off, off + b - a, getattr(self, k)[g.buf_lo + a:g.buf_lo + b], g.data)
        return out

    def state_dict(self) -> dict:
        """OffloadAdam's state_dict: {"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}, each state the parameter's full tensor, gathered from the shards
        (collective: every rank calls it; a checkpoint of it resumes at any stage and dp)."""
        self._host_state()  # the buckets' copies out are done
        step = torch.tensor(float(self.step_count), device="cpu")
        full = {k: self._full(getattr(self, k)) for k in self.STATE_KEYS}
        state = {i: {"step": step, **{k: full[k][i] for k in self.STATE_KEYS}} for i in range(len(self.params))}
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                 "bsize": self.bsize, "zero": self.zero, "offload": self.offload,
                 "max_grad_norm": self.max_grad_norm, "params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state_dict of full tensors (this optimizer's, OffloadAdam's or one of any other
        shard count): each rank keeps its shard. Every entry is checked before anything is written."""
        self._host_state()  # the buckets' copies out are done
        entries, g, step = checked_state("DistributedAdam", state_dict, self.params, self.STATE_KEYS)
        entry = {id(p): s for p, s in zip(self.params, entries)}
        with torch.no_grad():
            for group in self.groups:
                lo, hi = group.buf_lo, group.buf_hi
                for k in self.STATE_KEYS:
                    buf = getattr(self, k)
                    flat = self._gather_flat(group, lambda p, k=k: entry[id(p)][k].to(buf.device, buf.dtype))
                    buf[lo:hi].copy_(flat[group.lo - group.start:group.hi - group.start])
        if self.units is not None:
            self._refresh_shards()
        self.lr, self.betas, self.eps, self.weight_decay = g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]
        self.step_count = step


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
