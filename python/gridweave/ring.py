"""The engine's ring on one grid axis (Li et al.'s sequence parallelism): neighbours and
double-buffered exchanges of torch tensors; grid.ring(axis) makes one, the ring attentions
(autograd/ring.py) pass their blocks around it."""
from __future__ import annotations

import torch

from . import _C
from ._buffers import view


class Ring:
    """The engine's ring on one axis, with double-buffered exchanges of torch tensors
    (grid.ring(axis) makes one)."""

    def __init__(self, grid, axis):
        self.grid, self.axis = grid, axis
        self.native = _C.Ring(grid.comm(axis, "ring"))
        self.size, self.rank = self.native.size, self.native.rank

    def source_at(self, step):
        return self.native.source_at(step)

    def pass_on(self, tensors, step):
        """Start sending `tensors` to the next rank; returns (work, tensors from the previous rank)."""
        send = [t.contiguous() for t in tensors]
        if self.size == 1:  # a ring of one passes to itself
            return _Exchange(self.native.exchange([], [], step), send, send, self.grid.timeout)
        device = send[0].device
        # a transport that takes host memory only (Gloo) carries CUDA blocks through host copies
        staged = self.grid.comm(self.axis, "ring").device == _C.Device.CPU and device.type == "cuda"
        if staged:
            send = [t.to("cpu") for t in send]
        recv = [torch.empty_like(t) for t in send]
        work = self.native.exchange([view(t) for t in send], [view(t) for t in recv], step)
        return _Exchange(work, send, recv, self.grid.timeout, device if staged else None)


class _Exchange:
    def __init__(self, work, send, recv, timeout, device=None):
        self.work, self.send, self.recv, self.timeout, self.device = work, send, recv, timeout, device

    def wait(self):
        self.work.wait(self.timeout)
        return self.recv if self.device is None else [t.to(self.device) for t in self.recv]
