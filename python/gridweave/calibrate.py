"""`gridweave bench --calibrate`: measure this machine's alpha (latency per message), beta
(seconds per byte), all-reduces per line size, GEMM rate, element-wise memory bandwidth and
per-op, per-collective and per-step overheads, and write them as a cluster preset for gw.plan.

Every rank measures at the same time, so the numbers are the ones a job of this many ranks
sees: on a small machine ranks share cores, and a rate measured alone would be too fast.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from . import plan
from .errors import GridError
from .grid import LinePart, Span, init, shutdown
from .measure import call_rate, device_sync, float8_gemm_rate, gemm_costs, probe_size, relative_fit, vector_bandwidth
from .models import ModelConfig
from .nn.dense import DenseTransformerLayer
from .optim import OffloadAdam
from .plan.record import Census
from .config import TrainConfig
from .train import build, train_step


# the head sizes attention_by_head_size times: every one to 32 (torch's CPU kernel took 13 ns a
# query x key pair at 8, 12 at 10, 7 at 14, 5 at 16 and 14 at 28, one core: its vector loops' cut
# of the head, not its FLOPs), then the wider common ones
ATTENTION_HEAD_SIZES = tuple(range(8, 33)) + (40, 48, 56, 64, 80, 96, 128)
# (sequence, heads) each is timed at, over the device's probe batch (measure.PROBE_SIZES: 4 on a
# CPU): few short rows (a kernel's setup), many short rows (each row's), long rows (each pair's)
ATTENTION_SHAPES = ((32, 1), (32, 8), (256, 2))


def attention_by_head_size(window: float = 4.0, device="cpu", dtype=torch.float32) -> tuple:
    """(seconds per kernel, per query row, and per query x key pair at each of
    ATTENTION_HEAD_SIZES) of torch's fused causal attention, forward and backward, each head size
    timed at ATTENTION_SHAPES (fit_attention; Cluster.attention_by_head_size). Over 108 other
    shapes (head sizes 8-64, sequences 16-256, 4-48 rows of batch x heads; one core) it was off by
    12% (the median) and 45% at worst, where a FLOP rate, a row and a pair cost fitted on those
    shapes themselves were off by 19% and 80%."""
    timed, batch = [], probe_size(device, "attention_batch")
    per = window / (len(ATTENTION_HEAD_SIZES) * len(ATTENTION_SHAPES))
    for d in ATTENTION_HEAD_SIZES:
        for seq, heads in ATTENTION_SHAPES:
            shape = (batch, heads, seq, d)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(shape, device=device, dtype=dtype)

            def step():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            timed.append((d, seq, batch * heads, 1 / call_rate(step, per, device)))
    call_s, row_s, pair_s = fit_attention(timed)
    return (call_s, row_s, *(pair_s[d] for d in ATTENTION_HEAD_SIZES))


def fit_attention(timed: list) -> tuple:
    """(call_s, row_s, {head size: pair_s}) of timed fused causal attentions, forward and backward
    ((head size, sequence, batch x heads, seconds), ...): the relative least squares of
    t = 2 call_s + 2 b h s x row_s + b h s^2 x pair_s(d) (its two kernels, each over every query
    row, and the pairs under the causal mask, each kernel's)."""
    sizes = sorted({d for d, *_ in timed})
    columns = [[2.0] * len(timed), [2.0 * bh * s for _, s, bh, _ in timed]]
    columns += [[float(bh * s * s) if d == e else 0.0 for d, s, bh, _ in timed] for e in sizes]
    call_s, row_s, *pair_s = relative_fit(columns, [t for *_, t in timed])
    return call_s, row_s, dict(zip(sizes, pair_s))


# the loss's logits a softmax_sizes row is timed at: a small shape's fit in the caches, a large one's not
SOFTMAX_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)


def softmax_sizes(vector_Bps: float, window: float = 0.3, device="cpu", dtype=torch.float32) -> tuple:
    """plan.Cluster.softmax_by_size: softmax_costs at each of SOFTMAX_SIZES elements. With 8 ranks
    on 2 cores an element beyond its bytes took 4-7 ns at 2^16-2^18 elements and 100 ns at
    2^20-2^22 on one host (the logits then out of its caches), 5-8 ns at every size on another
    (32 MiB of L3): where the cliff lies is the host's, so it is measured, not assumed."""
    return tuple(softmax_costs(vector_Bps, window, device, dtype, elements=n) for n in SOFTMAX_SIZES)


def softmax_costs(vector_Bps: float, window: float = 1.0, device="cpu", dtype=torch.float32,
                  elements: int | None = None) -> float:
    """Seconds per element of a log-softmax over the main job's vocabulary (forward and backward,
    the loss's kernels) beyond its bytes at `vector_Bps`: the further passes over each row (its
    maximum, the sum of exponentials). On this CPU 0.7-1.2 ns an element against 0.33 for one pass
    of its bytes (one core). 0 where one pass is all it costs. elements: the logits' size (None: a
    step's out of the caches)."""
    vocab = TrainConfig().vocab
    size = elements or max(probe_size(device, "vector"), 1 << 22)
    rows = max(1, size // vocab)
    x = torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, vocab, device=device, dtype=dtype)

    def step():
        torch.log_softmax(x, -1).backward(grad)

    seconds = 1 / call_rate(step, window, device)
    one_pass = 5 * dtype.itemsize * x.numel() / vector_Bps  # forward reads and writes, backward reads two, writes
    return max(0.0, seconds - one_pass) / (2 * x.numel())


def host_link(window: float = 1.0, device="cpu", dtype=torch.float32) -> float:
    """Bytes/s of a copy from pinned host memory to the device and back, one after the other, as
    an offloaded optimizer's buckets cross (PCIe); 0 where the device's memory is the host's."""
    if torch.device(device) == torch.device("cpu"):
        return 0.0
    numel = probe_size(device, "vector")
    host = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)  # the host side: OffloadAdam's pinned state
    dev = torch.empty(numel, dtype=dtype, device=device)

    def step():
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)

    return 2 * host.nbytes * call_rate(step, window, device)


def offload_bucket(window: float = 1.0, device="cpu", dtype=torch.float32) -> float:
    """Seconds of each bsize-element bucket of OffloadAdam's staged step (AxoNN's device buckets:
    the host state copied in and out, the update's kernels), from steps of 8 and 32 buckets of a
    bsize small enough that its bytes are a rounding error; 0 where the device's memory is the
    host's (the state is updated in place, no buckets)."""
    if torch.device(device) == torch.device("cpu"):
        return 0.0
    bsize = 1 << 12

    def seconds(buckets: int) -> float:
        p = torch.nn.Parameter(torch.zeros(buckets * bsize, device=device, dtype=dtype))
        p.grad = torch.zeros_like(p)
        opt = OffloadAdam([p], bsize=bsize)
        return 1 / call_rate(opt.step, window, device)

    return max(0.0, (seconds(32) - seconds(8)) / 24)


def make_cublas_workspaces(device) -> None:
    """Makes cuBLAS's workspaces before device memory is measured: they are the library's, as the
    CUDA context is. torch keeps one per thread and stream, and backward runs on autograd's
    device thread, so a product forward and backward makes both (an H100 counted the backward
    thread's 32 MiB in a step otherwise)."""
    a = torch.ones(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()


def _layer_step(cfg: ModelConfig, batch: int, device, dtype):
    """A call of one gridweave layer of `cfg`'s forward and backward on `batch` sequences."""
    layer = DenseTransformerLayer(cfg.hidden, cfg.heads, cfg.ffn, bias=cfg.bias, arch=cfg.arch, device=device,
                                  dtype=dtype)
    x = torch.randn(batch, cfg.seq, cfg.hidden, device=device, dtype=dtype, requires_grad=True)

    def step():
        layer(x).sum().backward()

    return step


def launch_overhead(window: float = 1.0, device="cpu", dtype=torch.float32) -> float:
    """Seconds each kernel costs beyond its work, in a real layer: a tiny Llama layer of
    gridweave's (no work to speak of) forward and backward, over its kernels as the planner
    counts them (recorder.Census). It holds what a kernel alone does not: Python,
    module and autograd bookkeeping between kernels."""
    step = _layer_step(ModelConfig("llama", 64, 16, 2, 1, 8), 1, device, dtype)
    with Census() as census:
        step()
    return 1 / call_rate(step, window, device) / (census.calls + census.kernels)


# ---- resident memory on the host (what gw.plan's memory is measured against on CPU ranks) ----


M_MMAP_THRESHOLD = -3  # malloc.h
COUNTING_MMAP_THRESHOLD = 128 << 10  # glibc's initial threshold
SETTLED_MMAP_THRESHOLD = 32 << 20  # where glibc's sliding threshold ends (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6")


@contextlib.contextmanager
def resident_accounting():
    """Resident memory that measures what a job holds, within this block. glibc's mmap threshold
    slides up (to 32 MiB) once a large block is freed, after which freed tensors stay in the
    heap and the resident set keeps them: measured on one rank, 189 MiB of growth against 134
    MiB of state and live tensors. Fixed at 128 KiB every tensor past that size is returned when
    freed, so RSS measures what the job holds, as CUDA's max_memory_allocated does (its cache,
    like glibc's, is the allocator's). But then every such tensor is a fresh mapping, faulted in
    page by page: a training step here ran 9-13% slower, GEMMs of 256 x 256 too. So time
    nothing inside: on leaving, the threshold is set where glibc's own settles, and freed
    memory is reused as in any job."""
    _libc().mallopt(M_MMAP_THRESHOLD, COUNTING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _libc().mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_THRESHOLD)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """The resident set's high-water mark since the process started or restart_peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def restart_peak() -> None:
    """Free memory back to the system (what came before would hide the next growth), then
    restart the resident set's high-water mark from now ("5")."""
    import gc

    gc.collect()
    _libc().malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# up to 16 MiB: below a few MiB alpha (milliseconds where ranks share cores) hides beta; above
# tens of MiB a CPU ring leaves the caches and its bandwidth falls off a line (64 MiB: 7x 16 MiB's time)
RING_SIZES = tuple(1 << k for k in (13, 16, 18, 20, 22, 24))


def ring_all_gather(grid, sizes=RING_SIZES, reps: int = 21, axis="dp", active: bool = True) -> dict:
    """Seconds of the engine's ring all-gather over `axis` (default: all ranks), per output size
    (bytes): the usual alpha-beta calibration, t = (g-1) alpha + (g-1)/g n beta
    (plan.collective_time). Ranks not `active` only keep the barriers (their lines stay idle)."""
    out = {}
    g = grid.size(axis)
    for nbytes in sizes:
        part = torch.zeros(max(1, nbytes // 4 // g), device=grid.device)
        out[nbytes] = _median_seconds(grid, (lambda: grid.all_gather(part, axis)) if active else (lambda: None), reps)
    return out


# a step's all-reduces: activations, gradient chunks and buckets (past a few MiB a CPU ring leaves the caches)
ALL_REDUCE_SIZES = tuple(1 << k for k in (13, 16, 18, 20, 22))


def all_reduce_lines(grid, sizes=ALL_REDUCE_SIZES, reps: int = 11, rounds: int = 3) -> dict:
    """{members: {bytes: seconds}}: the engine's all-reduce over lines of every size that divides
    a node's ranks (blocks of consecutive ranks), every line of the size busy at once, each rank
    issuing reps of them back to back; the slowest rank's mean, the median of `rounds`. As in a
    step, the lines are not held together by barriers and drift apart, and the step waits for the
    slowest: where ranks share cores, four 2-member lines took 1.0-1.3 ms an all-reduce between
    barriers, 2.0-2.5 back to back, 1.8 inside a training step of row:2 x dp 4."""
    per_node, out, sync = grid.ranks_per_node, {}, device_sync(grid.device)
    for g in range(2, per_node + 1):
        if per_node % g:
            continue
        axis = "dp" if g == grid.world_size else LinePart(("dp",), Span.WITHIN, g)
        out[g] = {}
        for nbytes in sizes:
            t = torch.zeros(max(1, nbytes // 4), device=grid.device)
            grid.all_reduce(t, axis)  # connections made, buffers allocated
            means = []
            for _ in range(rounds):
                sync()
                grid.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    grid.all_reduce(t, axis)
                sync()  # a stream-ordered transport's (NCCL's) all-reduces are queued, not done
                means.append(_slowest(grid, (time.perf_counter() - t0) / reps))
            out[g][nbytes] = statistics.median(means)
    return out


def busy_speedup(grid, window: float = 0.3, rounds: int = 2, device="cpu", dtype=torch.float32) -> tuple:
    """plan.Cluster.busy_speedup: for k = 1 .. a node's ranks, a rank's rate at a small Llama
    layer's forward and backward (a step's mix of products and element-wise kernels) with the
    first k ranks of each node running it and the rest waiting, over its rate with all of them
    running; the median of `rounds` (the all-busy rate each round's own). Where ranks share cores
    a pipeline's bubble leaves some idle: those running go faster, by this much."""
    per_node = grid.ranks_per_node
    step = _layer_step(ModelConfig("llama", 64, 128, 4, 1, 64), 2, device, dtype)
    ratios = [[] for _ in range(per_node)]
    for _ in range(rounds):
        rates = []
        for k in range(1, per_node + 1):
            grid.barrier()
            mine = call_rate(step, window, device) if grid.rank % per_node < k else 0.0
            t = torch.tensor([mine], dtype=torch.float64, device=grid.device)
            grid.all_reduce(t, "dp")  # every node's running ranks' rates, summed
            rates.append(float(t) / (k * grid.world_size // per_node))
        for k, rate in enumerate(rates):
            ratios[k].append(rate / rates[-1])
    return tuple(statistics.median(r) for r in ratios)


def _slowest(grid, seconds: float) -> float:
    """The largest of every rank's `seconds` (what a step or a line of them waits for)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=grid.device)
    grid.all_reduce(t, "dp", op="max")
    return float(t)


def fit_all_reduce(times: dict) -> tuple:
    """plan.Cluster.all_reduce_s of all_reduce_lines' times: (members, seconds, seconds per byte)
    for each line size, t = seconds + bytes x per byte in relative least squares (the small
    all-reduces a step issues most weigh as much as the large)."""
    rows = []
    for g, by_size in sorted(times.items(), key=lambda item: int(item[0])):  # keys as JSON writes them too
        sizes = [float(n) for n in by_size]
        fixed, per_byte = relative_fit([[1.0] * len(sizes), sizes], list(by_size.values()))
        rows.append((int(g), fixed, per_byte))
    return tuple(rows)


def scalar_all_reduce(grid, reps: int = 21) -> float:
    """Seconds of a one-element float64 all-reduce over every rank (the step's loss, its gradient
    norm): the median of reps, each between barriers."""
    t = torch.zeros(1, dtype=torch.float64, device=grid.device)
    return _median_seconds(grid, lambda: grid.all_reduce(t, None), reps)


def _median_seconds(grid, op, reps: int) -> float:
    """The median seconds of op() over reps runs, each started on every rank at once (a barrier
    first), after one untimed run (connections made, buffers allocated)."""
    sync = device_sync(grid.device)
    op()
    ts = []
    for _ in range(reps):
        sync()
        grid.barrier()
        t0 = time.perf_counter()
        op()
        sync()  # a stream-ordered transport's (NCCL's) op is queued, not done, when the call returns
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fit_ring(times: dict, g: int) -> tuple:
    """(alpha, beta) of one ring step, alpha + (n / g) beta, from a g-member ring's times."""
    return fit_alpha_beta({n / max(g, 2): t / max(g - 1, 1) for n, t in times.items()})


def fit_alpha_beta(times: dict) -> tuple:
    """Least squares t = alpha + beta * bytes."""
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - beta * mx, 1e-7)
    return alpha, max(beta, 1e-12)


def measure(grid, fixed: bool = True, dtype=torch.float32, prefix: str = "calibrate") -> dict:
    """Every rank of `grid` measures at once; the medians over ranks, as a cluster preset.
    fixed: also fit the per-kernel and per-collective costs on small training steps.
    dtype: the compute dtype of the jobs the preset will plan (the planner has one GEMM rate:
    a GPU's bf16 rate is many times its fp32 one).
    prefix: the store keys of the small grids the fixed costs are timed on; a second calibration
    on the same store takes another (reused keys hand a rank its peers' stale addresses)."""
    g, per_node = grid.world_size, grid.ranks_per_node
    times = ring_all_gather(grid) if g > 1 else {8: 1e-5, 1 << 20: 1e-3}
    alpha, beta = fit_ring(times, g)
    inter_alpha, inter_beta = alpha, beta
    if per_node < g:  # several nodes: the links inside a node, and between nodes, apart
        times = ring_all_gather(grid, axis=LinePart(("dp",), Span.WITHIN))  # every node at once
        alpha, beta = fit_ring(times, per_node)
        # between nodes: one ring, of each node's first rank: one flow on each link, which is what
        # the planner's link bandwidth means (it shares a node's links among the lines that cross)
        across = ring_all_gather(grid, axis=LinePart(("dp",), Span.ACROSS), active=grid.rank % per_node == 0)
        inter_alpha, inter_beta = fit_ring(across, g // per_node)
        times = {"within_node": times, "across_nodes": across}
    scalar = scalar_all_reduce(grid) if g > 1 else 0.0
    all_reduces = all_reduce_lines(grid) if per_node > 1 else {}
    cores = len(os.sched_getaffinity(0))
    speedup = busy_speedup(grid, device=grid.device, dtype=dtype) if per_node > cores else ()
    local = []
    for probe in (gemm_costs, vector_bandwidth, launch_overhead, attention_by_head_size, host_link, offload_bucket):
        grid.barrier()
        out = probe(device=grid.device, dtype=dtype)
        local.extend(out if isinstance(out, tuple) else (out,))
    grid.barrier()
    local.append(softmax_costs(local[2], device=grid.device, dtype=dtype))  # beyond this rank's vector bandwidth
    grid.barrier()
    local.append(float8_gemm_rate(device=grid.device))
    grid.barrier()
    local.extend(softmax_sizes(local[2], device=grid.device, dtype=dtype))
    local = torch.tensor(local, dtype=torch.float64, device=grid.device)
    every = grid.all_gather(local.unsqueeze(0), "dp", dim=0) if grid.world_size > 1 else local.unsqueeze(0)
    heads = len(ATTENTION_HEAD_SIZES)
    (gemm, gemm_bandwidth, vector, launch, attention_call, attention_row, *rest) = (
        statistics.median(every[:, k].tolist()) for k in range(len(local)))
    pair_s, (link, bucket, softmax, f8, *by_size) = rest[:heads], rest[heads:]
    preset = {"name": "local", "about": f"measured by gridweave bench --calibrate with {grid.world_size} ranks at once"
                                        f" in {str(dtype).removeprefix('torch.')}",
            "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size)),
            "intra_alpha_s": alpha, "intra_bandwidth_Bps": 1 / beta,
            "inter_alpha_s": inter_alpha, "inter_bandwidth_Bps": 1 / inter_beta, "nics_per_node": 1,
            "gemm_flops": gemm, "float8_gemm_flops": f8, "gemm_bandwidth_Bps": gemm_bandwidth,
            "vector_bandwidth_Bps": vector,
            "launch_s": launch, "attention_call_s": attention_call, "attention_row_s": attention_row,
            "attention_by_head_size": [[d, t] for d, t in zip(ATTENTION_HEAD_SIZES, pair_s)], "softmax_element_s": softmax,
            "softmax_by_size": [[n, t] for n, t in zip(SOFTMAX_SIZES, by_size)], "host_link_Bps": link,
            "offload_bucket_s": bucket,
            "scalar_all_reduce_s": scalar, "all_reduce_s": fit_all_reduce(all_reduces),
            "measured_all_reduce_s": json.loads(json.dumps(all_reduces)),
            "memory_bytes": 24 * 2 ** 30, "ranks": grid.world_size,
            "cores_per_node": cores, "busy_speedup": list(speedup),
            "measured_all_gather_s": json.loads(json.dumps(times))}  # keys as strings
    if fixed and g > 1:
        terms, preset["fixed_cost_steps"] = fixed_costs(grid, preset, prefix=prefix)
        preset.update(terms)
    return preset


# The steps fixed_costs times: the main job's code (gw.train.train_step) on a model too small for
# its FLOPs and bytes to matter, on grids with few and with many collectives; and on the main job's
# own shape (one the planner may be tuned on), where the step's kernels are most of its time
_SMALL = dict(model="llama", hidden=32, heads=4, layers=2, seq=32, batch=8, microbatches=1, tokenizer="bytes")
# (and the same micro-batch at 2, 4 and 8 of them: a micro-batch's own fixed cost apart from the
# step's; and one micro-batch four times larger: the kernels' contention apart from both; more
# steps than terms, so no one noisy step decides a term)
_SMALL_GRIDS = ({}, {"tp": "row:2"}, {"sp": 2}, {"tp": "square:2"}, {"batch": 16, "microbatches": 2},
                {"batch": 32, "microbatches": 4}, {"batch": 64, "microbatches": 8}, {"batch": 32})
_MAIN_GRIDS = ({}, {"tp": "row:2"})


def _fixed_cost_configs() -> list:
    """(what, grid) of each step fixed_costs times."""
    return [("small", extra) for extra in _SMALL_GRIDS] + [("main", extra) for extra in _MAIN_GRIDS]


def _config_of(what: str, extra: dict) -> TrainConfig:
    """The TrainConfig of a timed step (its vocabulary: 256 bytes, or the main job's)."""
    extra = {"pp": 1, **extra}  # (TrainConfig's 0 lets the grid choose)
    return TrainConfig(**{**_SMALL, **extra}) if what == "small" else TrainConfig(**extra)


def fixed_costs(grid, preset: dict, steps: int = 7, prefix: str = "calibrate") -> tuple:
    """What the probes leave unexplained of real training steps on this machine under this
    many ranks (the main job's code: a tiny Llama on a few grids, and the main job's shape), each
    timed (the slowest rank, the median step): fit_fixed_costs's terms. Returns (those terms,
    the steps as measured and recorded). Each grid's steps follow each other, as a job's do (timed
    in rounds of every grid instead, collective_s came out about half)."""
    n = grid.world_size
    rows = []
    for i, (what, extra) in enumerate(_fixed_cost_configs()):
        cfg = _config_of(what, extra)
        try:
            shape = cfg.grid_shape(n)
        except Exception:  # a grid this world cannot hold
            continue
        g = init_like(grid, shape, cfg, f"{prefix}-{i}")
        torch.manual_seed(0)
        _, stage, opt, scaler = build(cfg, g, cfg.model_config(cfg.vocab))
        x = torch.randint(0, cfg.vocab, (cfg.batch // shape["dp"], cfg.seq), generator=torch.Generator().manual_seed(0),
                          device="cpu")  # a host batch, as the reader's
        times = []
        for step in range(steps + 2):
            grid.barrier()
            t0 = time.perf_counter()
            train_step(cfg, g, stage, opt, scaler, x, x.roll(1, 1))
            times.append(_slowest(grid, time.perf_counter() - t0))  # a step lasts as long as its slowest rank
        del stage, opt
        g.shutdown()
        rows.append(dict(model=what, grid=extra, measured_s=statistics.median(times[2:]), steps_s=times[2:]))
    return fit_fixed_costs(preset, rows), rows


def _predicted(preset: dict, row: dict, **terms) -> dict:
    """gw.plan.predict of a timed step (fixed_costs's row) on the preset, its fitted terms as given
    (none: not counted)."""
    import dataclasses

    cfg = _config_of(row["model"], row["grid"])
    shape = cfg.grid_shape(preset["ranks"])
    cluster = dataclasses.replace(plan.Cluster.of(preset), **{**dict(
        collective_s=0.0, step_s=0.0, microbatch_s=0.0, compute_scale=1.0, measured_call_s=0.0), **terms})
    grid = plan.GridShape(dp=shape["dp"], pp=shape["pp"], tp=cfg.mode, sp=shape["sp"])
    return plan.predict(plan.model_of(cfg), grid, cluster, microbatches=cfg.microbatches, **cfg.planned_optimizer())


def fit_fixed_costs(preset: dict, rows: list) -> dict:
    """The preset's fitted terms from timed steps (fixed_costs's rows: what, grid, measured_s;
    each is given its prediction without them, its kernels, the collectives each term is charged
    to, its kernels' seconds and what the terms leave unexplained): the least squares (each error
    relative to its step's time) of what the prediction leaves unexplained as step_s +
    micro-batches x microbatch_s + collectives x collective_s + measured all-reduces x
    measured_call_s + (compute_scale - 1) x the kernels' seconds.
    The per-kernel cost is the probe's, not an unknown of the fit: kernels and collectives grow
    together over these grids, so a fit of both traded one for the other from run to run (2 to
    33 us a kernel on one machine). Where ranks share cores, a collective's thread handoffs wait
    for a core; that, not alpha, is what makes many small collectives expensive; and a step's
    kernels run slower than the probes that time one kind at a time."""
    for r in rows:
        p = _predicted(preset, r)
        r.update(kernels=p["kernels"], microbatches=p["microbatches"], collectives=p["fixed_cost_collectives"],
                 measured_collectives=p["measured_collectives"], predicted_s=p["step_time_s"])
        # the kernels' seconds: a step without a pipeline is linear in compute_scale
        r["compute_s"] = _predicted(preset, r, compute_scale=2.0)["step_time_s"] - p["step_time_s"]
    step_s, micro_s, collective_s, call_s, scale = relative_fit(
        [[1.0] * len(rows), [r["microbatches"] for r in rows], [r["collectives"] for r in rows],
         [r["measured_collectives"] for r in rows], [r["compute_s"] for r in rows]],
        [r["measured_s"] - r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    terms = dict(step_s=step_s, microbatch_s=micro_s, collective_s=collective_s, measured_call_s=call_s,
                 compute_scale=1.0 + scale)
    for r in rows:  # what each step leaves unexplained, the terms fitted
        r["unexplained_s"] = r["measured_s"] - _predicted(preset, r, **terms)["step_time_s"]
    return terms


# what a calibration fits rather than measures (combine refits them)
FITTED_TERMS = ("step_s", "microbatch_s", "collective_s", "measured_call_s", "compute_scale")


def _median_of(values: list):
    """The element-wise median of equal-shaped JSON values (numbers, lists of them, lists of
    lists); of integers (counts, sizes) the lower median, one of them; the first where their
    shapes differ or are not numbers."""
    first = values[0]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return statistics.median_low(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return statistics.median(values)
    if all(isinstance(v, list) and len(v) == len(first) for v in values) and first:
        return [_median_of([v[i] for v in values]) for i in range(len(first))]
    return first


def combine(presets: list) -> dict:
    """One preset of several calibrations of one machine (measure's, in any order): each probe's
    median over them (two: their mean), each timed fixed-cost step's median, and the fitted terms
    refitted on those (fit_fixed_costs). A host whose speed moves by tens of percent over minutes
    is better described by calibrations that bracket a job than by the one before it."""
    if not presets:
        raise GridError("calibrate.combine: no presets to combine")
    out = {k: _median_of([p.get(k, presets[0][k]) for p in presets]) for k in presets[0]
           if k not in FITTED_TERMS and k != "fixed_cost_steps"}
    out["about"] = f"{presets[0]['about']}; the median of {len(presets)} calibrations"
    if all("fixed_cost_steps" in p for p in presets):
        key = lambda r: (r["model"], json.dumps(r["grid"], sort_keys=True))  # noqa: E731
        timed = {}
        for p in presets:
            for r in p["fixed_cost_steps"]:
                timed.setdefault(key(r), (r, []))[1].append(r["measured_s"])
        rows = [dict(model=r["model"], grid=r["grid"], measured_s=statistics.median(t)) for r, t in timed.values()]
        out.update(fit_fixed_costs(out, rows))
        out["fixed_cost_steps"] = rows
    else:  # no steps to refit on: the terms' own medians
        out.update({t: _median_of([p[t] for p in presets]) for t in FITTED_TERMS if all(t in p for p in presets)})
    return out


def init_like(grid, shape: dict, cfg, prefix: str):
    """A grid of `shape` over the same ranks and store as `grid`."""
    return init(dp=shape["dp"], pp=shape["pp"], tp=cfg.mode, sp=shape["sp"], store=grid._torch_store[0],
                   prefix=prefix, backend=grid.backend, timeout=grid.timeout)


def run(out: Path, dtype=torch.float32) -> dict:
    """Run inside 2+ ranks (torchrun): rank 0 writes the preset, measured in `dtype`."""
    torch.set_num_threads(1)
    grid = init(dp=int(os.environ.get("WORLD_SIZE", "1")))
    preset = measure(grid, dtype=dtype)
    if grid.rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(preset, indent=1))
    shutdown()
    return preset
