"""Rates of this process's device under the ranks running beside it: what the planner's
calibration (gridweave.calibrate) and the main job's MFU read."""
from __future__ import annotations

import statistics
import time

import torch

from . import float8


def device_sync(device):
    """What waits for the work queued on `device` (a timer's read on CUDA comes after it)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def call_rate(fn, window: float, device="cpu") -> float:
    """Calls of fn per second over a `window`-second run: every rank runs its window at the
    same time (after a barrier), so the rate is the one under this many ranks' contention.
    On CUDA the kernels queued in the window are waited for: the rate is the device's."""
    sync = device_sync(device)
    fn()
    sync()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window:
        fn()
        calls += 1
    sync()
    return calls / (time.perf_counter() - t0)


# The probes' sizes where a device's rate is reached: a CPU reaches its GEMM rate at 256^3 and
# its memory bandwidth at 1 MiB a tensor; on a GPU those sizes are launch-bound (an H100
# measured 1.1 TFLOP/s at 256^3 fp32), so there the probes are large enough to fill it.
PROBE_SIZES = {"cpu": {"gemm": 256, "vector": 1 << 18, "attention_batch": 4},
               "cuda": {"gemm": 4096, "vector": 1 << 26, "attention_batch": 64}}


def probe_size(device, what: str) -> int:
    """The size the rate probes use on `device` (PROBE_SIZES; other devices as the CPU)."""
    return PROBE_SIZES.get(torch.device(device).type, PROBE_SIZES["cpu"])[what]


def gemm_rate(n: int | None = None, window: float = 1.0, device="cpu", dtype=torch.float32) -> float:
    """FLOP/s of an n x n matmul in `dtype` on this process's device (n: the device's probe size)."""
    n = n or probe_size(device, "gemm")
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n ** 3 * call_rate(lambda: a @ b, window, device)


def float8_gemm_rate(window: float = 1.0, device="cpu", dtype=None) -> float:
    """FLOP/s of a float8 matrix product on this device, as the planner counts one (its operands'
    casts apart): two e4m3 operands with their scales into bf16, through torch._scaled_mm on CUDA;
    where float8 is emulated (gw.float8.emulated: every other device) the fp32 product of the upcast
    operands, as torchao's emulation runs it. 0 without torchao (the planner then uses gemm_flops)."""
    try:
        e4m3 = float8.gather_dtype()
    except Exception:  # noqa: BLE001 (torchao absent: float8 cannot run here at all)
        return 0.0
    n = probe_size(device, "gemm")
    a = torch.randn(n, n, device=device).to(e4m3)
    b = torch.randn(n, n, device=device).to(e4m3).t()  # column-major, as _scaled_mm takes its second operand
    one = torch.ones((), device=device)
    if float8.emulated(device):
        def product():
            return a.float() @ b.float()
    else:
        def product():
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    return 2 * n ** 3 * call_rate(product, window, device)


def relative_fit(columns: list, seconds: list, relative_to: list | None = None) -> list:
    """Least squares, in relative error, of seconds = sum_j x_j columns[j]: the per-unit costs
    x_j (none below 0: a term the probes cannot see is left out, the others refitted). Each
    error is relative to its seconds, or to relative_to's (where seconds are a residual that may
    be near 0: the whole time it is part of)."""
    import numpy as np

    scale = np.array(seconds if relative_to is None else relative_to, dtype=float)[:, None]
    a = np.array(columns, dtype=float).T / scale
    target = np.array(seconds, dtype=float) / scale[:, 0]
    keep = list(range(a.shape[1]))
    while keep:
        x, *_ = np.linalg.lstsq(a[:, keep], target, rcond=None)
        if (x > 0).all():
            out = [0.0] * a.shape[1]
            for j, v in zip(keep, x):
                out[j] = float(v)
            return out
        keep.pop(int(np.argmin(x)))
    return [0.0] * a.shape[1]


# Copies of a probe's operands it cycles through, at least this many bytes in all: a step's
# products read operands other kernels have since pushed out of the caches (a CPU's last level
# cache is tens of MiB, shared by the ranks; an H100's L2 50 MiB)
COLD_BYTES = 64 << 20


def gemm_costs(window: float = 1.0, device="cpu", dtype=torch.float32) -> tuple:
    """(FLOP/s, operand bytes/s) of matrix products whose operands come from memory, as a
    training step's do: t = 2 m n k / rate + (m k + k n + m n) e / bandwidth, fitted (relative
    least squares) on a square product of the probe size and two an eighth as thin, each cycling
    through copies of its operands larger than the caches (operands kept hot ran 100-108 GFLOP/s on
    this CPU where the same products inside a step ran 72). Bandwidth 0: the probes saw no operand
    cost."""
    n = probe_size(device, "gemm")
    flops, nbytes, seconds = [], [], []
    for m, k, c in ((n, n, n), (n // 8, n, n), (n, n // 8, n)):
        size = (m * k + k * c + m * c) * dtype.itemsize
        sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, c, device=device, dtype=dtype),
                 torch.empty(m, c, device=device, dtype=dtype)) for _ in range(max(1, min(64, -(-COLD_BYTES // size))))]
        turn = [0]

        def product():
            a, b, out = sets[turn[0] % len(sets)]
            turn[0] += 1
            torch.mm(a, b, out=out)

        seconds.append(1 / call_rate(product, window / 3, device))
        flops.append(2.0 * m * k * c)
        nbytes.append(float(size))
    per_flop, per_byte = relative_fit([flops, nbytes], seconds)
    if not per_flop:  # the square product's own rate
        return flops[0] / seconds[0], 0.0
    return 1 / per_flop, (1 / per_byte if per_byte else 0.0)


def vector_bandwidth(numel: int | None = None, window: float = 1.0, device="cpu", dtype=torch.float32) -> float:
    """Bytes/s of an element-wise add (two reads, one write) on tensors of `numel` elements."""
    numel = numel or probe_size(device, "vector")
    a, b, c = (torch.randn(numel, device=device, dtype=dtype) for _ in range(3))
    return 3 * a.element_size() * numel * call_rate(lambda: torch.add(a, b, out=c), window, device)


class StepPhases:
    """Where a training step's time goes, seconds summed over the steps it timed:
    forward and backward (the model's own work, every micro-batch; the backward includes the
    gradient hooks that start reductions), reduction (waiting for the gradient sums the backward
    did not hide), optimizer (the rest of the optimizer's step: norm, update, write-back or
    gather), waiting (the pipeline's wall time less its forward and backward: receives and the
    schedule) and bookkeeping (the rest of the step: micro-batch cuts, the loss's reduction). On a
    CUDA device every phase boundary synchronises it (what timing needs, and costs)."""

    NAMES = ("forward", "backward", "reduction", "optimizer", "waiting", "bookkeeping")
    # a rank's own work, and where it waits for its peers (the reductions, the pipeline's receives,
    # the loss's all-reduce in the step's bookkeeping): a straggler's peers wait in the latter
    COMPUTE, WAIT = ("forward", "backward"), ("reduction", "waiting", "bookkeeping")

    def __init__(self, device="cpu"):
        self._sync = device_sync(device)
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.split: list = []  # each step's (compute, wait) seconds
        self._closed = (0.0, 0.0)  # compute and wait summed over the steps closed so far

    @property
    def steps(self) -> int:
        """Steps timed (closed by end_step)."""
        return len(self.split)

    def end_step(self) -> None:
        """A step is over: its compute and wait seconds are kept (split)."""
        now = tuple(sum(self.seconds[k] for k in names) for names in (self.COMPUTE, self.WAIT))
        self.split.append((now[0] - self._closed[0], now[1] - self._closed[1]))
        self._closed = now

    def clock(self) -> float:
        """A timestamp after the device's queued work (CUDA) has finished."""
        self._sync()
        return time.perf_counter()

    def timed(self, name: str, fn, *args):
        """fn(*args), its wall time less what the phases timed inside it took added to phase
        `name` (so the pipeline's wall time less its forward and backward is waiting, the step's
        less every phase is bookkeeping)."""
        t0, inside = self.clock(), sum(self.seconds.values())
        try:
            return fn(*args)
        finally:
            self.seconds[name] += self.clock() - t0 - (sum(self.seconds.values()) - inside)

    def per_step(self) -> dict:
        """Each phase's mean seconds a step, and their sum."""
        n = max(self.steps, 1)
        out = {k: v / n for k, v in self.seconds.items()}
        out["step"] = sum(out.values())
        return out

    @classmethod
    def describe(cls, per_step: dict) -> str:
        """One line of a per_step() dict: each phase's milliseconds a step and share of it."""
        total = per_step["step"] or 1.0
        return ", ".join(f"{k} {per_step[k] * 1e3:.1f} ms ({100 * per_step[k] / total:.0f}%)" for k in cls.NAMES) + \
            f"; step {per_step['step'] * 1e3:.1f} ms"


class StragglerDetector:
    """Megatron-LM's straggler detector, per pipeline stage: every `every` steps each rank's
    forward and backward seconds a step over the window (its StepPhases: the model's own work)
    and its waits (StepPhases.WAIT) are gathered on every rank (one all-gather); a rank
    whose forward and backward exceed its stage's median rank's by more than `threshold`, in
    `windows` windows running, is named. Ranks of one stage do the same work, so their times
    compare; a stage of one rank has no peer to be compared with."""

    def __init__(self, grid, phases: StepPhases, threshold: float, every: int, windows: int):
        self.grid, self.phases = grid, phases
        self.threshold, self.every, self.windows = threshold, every, windows
        self._seen = len(phases.split)  # the steps of earlier windows
        self._running: dict = {}  # rank -> windows running it was slow in
        self.named: list = []  # every naming: its step, rank, coordinates, seconds, stage median

    def after_step(self, step: int) -> list:
        """Collective over the grid at the end of each window (every rank calls it every step):
        the ranks named this window (each a dict: step, rank, coords, compute_s, wait_s,
        median_s, windows)."""
        if (step + 1) % self.every:
            return []
        window, self._seen = self.phases.split[self._seen:], len(self.phases.split)
        compute, wait = (statistics.fmean(x) for x in zip(*window))
        mine = {"rank": self.grid.rank, "coords": dict(self.grid.coords), "compute_s": compute, "wait_s": wait}
        everyone = self.grid.all_gather_json(mine)
        stages = {}
        for r in everyone:
            stages.setdefault(r["coords"]["pp"], []).append(r["compute_s"])
        named = []
        for r in everyone:
            peers = stages[r["coords"]["pp"]]
            median = statistics.median(peers)
            slow = len(peers) > 1 and r["compute_s"] > median * (1 + self.threshold)
            self._running[r["rank"]] = self._running.get(r["rank"], 0) + 1 if slow else 0
            if self._running[r["rank"]] >= self.windows:
                named.append({**r, "step": step + 1, "median_s": median, "windows": self._running[r["rank"]]})
        self.named += named
        return named

    @staticmethod
    def describe(s: dict) -> str:
        """One log line of a naming."""
        where = ", ".join(f"{a}={i}" for a, i in s["coords"].items())
        return (f"straggler: rank {s['rank']} ({where}) forward+backward {s['compute_s'] * 1e3:.1f} ms a step, its "
                f"pipeline stage's median rank {s['median_s'] * 1e3:.1f} ms (+{100 * (s['compute_s'] / s['median_s'] - 1):.0f}%), "
                f"waiting {s['wait_s'] * 1e3:.1f} ms; slow {s['windows']} windows running, at step {s['step']}")


def timed(phases: StepPhases | None, name: str, fn, *args):
    """fn(*args), timed as phase `name` of `phases` when there is one."""
    return fn(*args) if phases is None else phases.timed(name, fn, *args)


class HostReads:
    """A census of what makes the host wait for the device (torch's own sync points): every read
    of a tensor's value on the host (aten._local_scalar_dense: .item(), bool(), float(), int()),
    every Tensor.tolist / .numpy / .cpu call, and every tensor made from Python data
    (aten.lift_fresh: torch.tensor(...), which on a GPU is a host-to-device copy). Each is
    filed under where it happened: "collective" (inside the grid's ops), "optimizer",
    "moe_dispatch" (a mixture of experts reading its groups' sizes: the token exchange's, or the
    float64 loop's), or "step" (anywhere else), named by the innermost gridweave frame. Ops whose
    output's shape depends on the values (nonzero, masked_select, unique, indexing by a mask: a
    host sync on a GPU) are counted apart, as shape_syncs. A context manager; counts() gives
    {"reads": {where: n}, "tensors_from_python": n, "shape_syncs": n, "sites": {site: n}}."""

    WHERE = (("collective", ("gridweave/grid.py", "gridweave/ring.py", "gridweave/autograd/comm.py")),
             ("optimizer", ("gridweave/optim/", "gridweave/precision.py")),
             ("moe_dispatch", ("gridweave/nn/moe.py",)))
    PATCHED = ("tolist", "numpy", "cpu")
    SHAPED = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and not census._in_patch:
                    census._note("read")
                elif func is torch.ops.aten.lift_fresh.default:
                    census._note("tensor")
                elif census._shaped(func, args, kwargs or {}):
                    census._note("shape")
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._saved = {}
        self._in_patch = False
        self.reads = {"collective": 0, "optimizer": 0, "moe_dispatch": 0, "step": 0}
        self.tensors_from_python = self.shape_syncs = 0
        self.sites = {}

    def _shaped(self, func, args, kwargs) -> bool:
        name = func.overloadpacket.__name__
        if name in self.SHAPED or (name == "repeat_interleave" and len(args) == 1 and kwargs.get("output_size") is None):
            return True  # repeat_interleave(repeats) without output_size reads the repeats' sum
        if name == "index" and len(args) > 1:  # a bool mask among the indices: nonzero inside
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return False

    def _site(self) -> tuple:
        import sys

        frame, site, where = sys._getframe(2), None, "step"
        while frame is not None:
            path = frame.f_code.co_filename.replace("\\", "/")
            if "gridweave/" in path and not path.endswith("gridweave/measure.py"):
                site = site or f"{path.rsplit('gridweave/', 1)[1]}:{frame.f_code.co_name}"
                for name, files in self.WHERE:
                    if where == "step" and any(f in path for f in files):
                        where = name
            frame = frame.f_back
        return where, site or "outside gridweave"

    def _note(self, kind: str) -> None:
        where, site = self._site()
        if kind == "tensor":
            self.tensors_from_python += 1
            site = "tensor from Python data at " + site
        elif kind == "shape":
            self.shape_syncs += 1
            site = "value-dependent shape at " + site
        else:
            self.reads[where] += 1
        self.sites[site] = self.sites.get(site, 0) + 1

    def __enter__(self):
        for name in self.PATCHED:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(t, *args, _real=real, **kwargs):
                if self._in_patch:  # re-entered through a torch function mode (a default device): one read
                    return _real(t, *args, **kwargs)
                self._note("read")
                self._in_patch = True  # its own element reads are this one read
                try:
                    return _real(t, *args, **kwargs)
                finally:
                    self._in_patch = False

            setattr(torch.Tensor, name, counted)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        self._saved = {}
        return False

    def counts(self) -> dict:
        return {"reads": dict(self.reads), "tensors_from_python": self.tensors_from_python,
                "shape_syncs": self.shape_syncs, "sites": dict(self.sites)}
