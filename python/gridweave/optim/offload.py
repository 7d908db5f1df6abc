"""AxoNN §V: the bucketed, offloaded mixed-precision optimizer, and the gradient all-reduce in
chunks of k x bsize overlapped with it."""
from __future__ import annotations

import contextlib

import torch

from ..errors import GridError
from ..measure import timed
from ..sharding import grad_norm_of, placement_of
from .base import GridOptimizer, _grad_hooks, _pinned, _Staging, adamw_, checked_state, dp_mean_scale


def gradient_chunks(params, grid, bsize: int, coarsening: int, backward: bool = False) -> tuple:
    """OffloadAdam's flat layout and its gradient all-reduces (the planner costs the same ones):
    the parameters grouped by the axes their gradients are summed over (gw.reduce_gradients'
    rule), so that each chunk's all-reduce has one set of axes. Returns (order, offset of each
    parameter, chunks (lo, hi, axes)), a chunk being k x bsize elements (AxoNN §V-B).
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



def master_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The masters' and states' dtype for a model's: fp32 of half-precision models; a float64 model
    (gridweave verify's) keeps float64."""
    return torch.promote_types(model_dtype, torch.float32)


def link_bytes_per_element(model_dtype: torch.dtype) -> int:
    """Bytes a staged step moves between the host and the device per element of a model in
    `model_dtype`: each bucket's weights and two states in and out (_Staging), and the master's
    write-back to the parameter."""
    return (_Staging.LINK_COPIES + 1) * master_dtype(model_dtype).itemsize


class OffloadAdam(GridOptimizer):
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
    order. staged: the update goes through the bsize device buckets (AxoNN, where the host
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
        self.dtype = master_dtype(self.params[0].dtype)
        flat = torch.empty(self.numel, dtype=self.dtype, device=host)
        for i, p in enumerate(self.params):
            flat[self._offset[i]:self._offset[i] + p.numel()] = p.detach().reshape(-1).to(host, self.dtype)
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
        self._staging = _Staging(self.bsize, self.dtype, dev) if self.staged else None
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
        (4 phi + 16 bsize with half-precision models, AxoNN §V); `without_offload` is the usual
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
                bad = self._or_norm_not_finite(bad)
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
        if g.dtype != self.dtype or isinstance(scale, torch.Tensor) or scale != 1.0:
            g = g.to(self.dtype) * scale  # descale the half-precision gradient in the master's dtype
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
