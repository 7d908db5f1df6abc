"""Seed 001 §V: the bucketed, offloaded mixed-precision optimizer, and the data-parallel
all-reduce in chunks of k x bsize overlapped with it."""
from __future__ import annotations

import math

import torch

from .errors import GridError


class OffloadAdam:
    """AdamW with fp32 master weights and Adam states in host memory, updated `bsize`
    elements at a time; the model keeps its own (fp16/bf16/fp32) weights and gradients.

    step() first all-reduces the gradients over `dp_axis` (averaged) in chunks of
    k x bsize: each chunk's all-reduce is started asynchronously, and while the next one
    travels the optimizer updates the buckets of the chunk that has arrived.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bsize=1 << 20,
                 grid=None, dp_axis="dp", coarsening=4):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise GridError("OffloadAdam got no parameters")
        if bsize < 1 or coarsening < 1:
            raise GridError("bsize and coarsening must be >= 1")
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.bsize, self.k, self.grid, self.dp_axis = int(bsize), int(coarsening), grid, dp_axis
        self.numel = sum(p.numel() for p in self.params)
        host = torch.device("cpu")
        pin = torch.cuda.is_available()
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])
        self.master = flat.to(host).pin_memory() if pin else flat.to(host).clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        dev = self.params[0].device
        # Device buffers reused across buckets: weights, two states, descaled gradients.
        self._buf = {k: torch.empty(self.bsize, dtype=torch.float32, device=dev) for k in ("w", "m", "v", "g")}

    # ---- memory accounting (bytes on the device) ------------------------------------
    def device_bytes(self) -> dict:
        """Parameters + gradients in the model's dtype and the 16*bsize of bucket buffers
        (4 phi + 16 bsize with half-precision models, seed 001 §V); `without_offload` is the
        usual 20 phi (half weights and gradients, fp32 master, fp32 gradients, two states)."""
        model = sum(p.numel() * p.element_size() for p in self.params)
        return {"parameters_and_gradients": 2 * model, "buckets": 16 * self.bsize,
                "total": 2 * model + 16 * self.bsize, "without_offload": 20 * self.numel}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def _flat_grads(self):
        grads = []
        for p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.reshape(-1))
        return torch.cat(grads).contiguous()

    def step(self):
        self.step_count += 1
        grads = self._flat_grads()
        chunk = self.k * self.bsize
        dp = self.grid is not None and self.dp_axis in self.grid.axes and self.grid.axes[self.dp_axis] > 1
        scale = 1.0 / self.grid.axes[self.dp_axis] if dp else 1.0
        starts = list(range(0, self.numel, chunk))
        work = {}

        def launch(i):
            if dp and i < len(starts):
                lo = starts[i]
                work[i] = self.grid.all_reduce(grads[lo:lo + chunk], axis=self.dp_axis, async_op=True)

        launch(0)
        for i, lo in enumerate(starts):
            launch(i + 1)  # the next chunk travels while this one is optimized
            if i in work:
                work.pop(i).wait()
            hi = min(lo + chunk, self.numel)
            for b in range(lo, hi, self.bsize):
                self._bucket(grads, b, min(b + self.bsize, hi), scale)
        self._write_back()

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
        w.mul_(1 - self.lr * self.weight_decay)  # as torch.optim.AdamW
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = self.lr / (1 - b1 ** t)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(self.eps)
        w.addcdiv_(m, denom, value=-step_size)
        self.master[lo:hi].copy_(w)
        self.exp_avg[lo:hi].copy_(m)
        self.exp_avg_sq[lo:hi].copy_(v)

    def _write_back(self):
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(self.master[off:off + n].view_as(p).to(p.dtype))
                off += n
