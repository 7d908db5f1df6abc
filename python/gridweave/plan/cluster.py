"""The machines a plan is for: presets of alpha-beta links, GEMM and vector rates, memory (clusters/*.json)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GridError


PRESETS = Path(__file__).parent.parent / "clusters"  # the package's clusters/


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    intra_alpha_s: float
    intra_bandwidth_Bps: float
    inter_alpha_s: float
    inter_bandwidth_Bps: float  # per network link (nics_per_node of them per node)
    gemm_flops: float
    memory_bytes: float
    about: str = ""
    vector_bandwidth_Bps: float = 0.0  # memory-bound element-wise work (0: not counted)
    launch_s: float = 0.0  # fixed cost of each kernel or collective call
    nics_per_node: int = 1  # network links per node; lines leaving a node share them
    cores_per_node: int = 0  # CPU ranks: the cores they share (0: each rank has its own device)
    collective_s: float = 0.0  # fixed cost of each collective or message beyond alpha (threads handing off)
    step_s: float = 0.0  # fixed cost of each training step (its own bookkeeping: micro-batch cuts, loss, hooks)
    # fixed cost of each micro-batch on a stage beyond its kernels (its Python loop, the autograd engine's start)
    microbatch_s: float = 0.0
    attention_flops: float = 0.0  # FLOP/s of the fused attention kernels, forward and backward (0: gemm_flops)
    # FLOP/s of float8 products, their operands' casts included (0: gemm_flops): a GPU's float8
    # tensor cores (the data sheets: twice bf16's on H100 / H200), the CPU's emulated products
    float8_gemm_flops: float = 0.0
    attention_row_s: float = 0.0  # and their seconds per query row (batch x heads x sequence; 0: none)
    attention_score_s: float = 0.0  # and per query x key pair (0: none)
    softmax_element_s: float = 0.0  # a (log-)softmax kernel's seconds per element beyond its bytes' (0: none)
    gemm_bandwidth_Bps: float = 0.0  # bytes/s of the GEMMs' operands and outputs, read from memory (0: not counted)
    # bytes/s between the device and the host memory an offloaded optimizer keeps its state in (PCIe;
    # 0: they are one memory, CPU ranks): OffloadAdam then goes through device buckets (AxoNN §V)
    host_link_Bps: float = 0.0
    offload_bucket_s: float = 0.0  # and seconds of each bsize-element bucket's copies and update (0: its kernels')
    # measured seconds of a one-element all-reduce (the loss, the norm, the micro-batch count) over
    # every rank, its fixed costs included (0: alpha-beta). Gloo's ring sends only the non-empty
    # chunks: one element over 8 CPU ranks took 0.7 ms where alpha-beta says 2 (g - 1) alpha = 11
    scalar_all_reduce_s: float = 0.0
    # measured all-reduces inside a node: (members, seconds, seconds per byte of the buffer) of
    # the engine's all-reduce over lines of that many members, every line of the size busy at
    # once (calibrate.all_reduce_lines); such an all-reduce is costed from its row alone, every
    # other by alpha-beta. Where ranks share cores a ring step is a turn of the cores, not a wire's
    # latency: an 8-member all-reduce's 14 steps took what the all-gather's 7 (alpha's fit) did
    all_reduce_s: tuple = ()
    # fitted by calibrate on training steps of the main job's shape, beside step_s and collective_s
    # (1, 0, 0: not counted). A step's kernels run slower than the probes time them alone (ranks
    # sharing cores and caches mid-step): their seconds times compute_scale
    compute_scale: float = 1.0
    # each all-reduce all_reduce_s costs, further, amid a step: its peers arrive as the shared cores
    # schedule them, where the calibration timed the calls in lockstep
    measured_call_s: float = 0.0
    # where ranks share cores: a rank's rate with k of its node's ranks running (k = 1, 2, ...) over
    # its rate with all of them running, as calibrate.busy_speedup measures it (a pipeline's ranks
    # idle in its bubble lend theirs). One rank alone ran 5x, two 4.5x, four 2.1x (8 ranks on 2
    # cores: one thread uses one core, and 8 contend for caches). (): the cores' fair share
    busy_speedup: tuple = ()
    # and softmax_element_s measured at several sizes: ((elements, seconds per element), ...) by
    # size, calibrate.softmax_sizes. Where ranks share caches a small shape's logits stay in them
    # and a large one's do not (4-7 ns against 100 ns an element); (): softmax_element_s at any size
    softmax_by_size: tuple = ()
    # the fused attention kernels by the query's head size: ((head size, seconds per query x key
    # pair), ...), calibrate.attention_by_head_size, with attention_call_s each kernel and
    # attention_row_s each query row. torch's CPU kernel took 13 ns a pair at head size 8, 5 at
    # 16 and 14 at 28 (one core): not the FLOPs' d, so measured by head size. (): attention_flops,
    # attention_row_s and attention_score_s (a GPU preset's)
    attention_by_head_size: tuple = ()
    attention_call_s: float = 0.0  # with attention_by_head_size: each fused attention kernel's setup

    def __post_init__(self):  # a preset's JSON lists, hashable (the lines' cache keys on the cluster)
        object.__setattr__(self, "all_reduce_s", tuple(tuple(row) for row in self.all_reduce_s))
        object.__setattr__(self, "busy_speedup", tuple(self.busy_speedup))
        object.__setattr__(self, "softmax_by_size", tuple(sorted(tuple(row) for row in self.softmax_by_size)))
        object.__setattr__(self, "attention_by_head_size", tuple(sorted(tuple(row) for row in self.attention_by_head_size)))

    def attention_pair_s(self, head: float) -> float:
        """A fused attention kernel's seconds per query x key pair at head size `head`:
        attention_by_head_size's, linear between its rows, the smallest's below them and in
        proportion to the head size beyond the largest (its products' FLOPs then dominate)."""
        sizes, seconds = zip(*self.attention_by_head_size)
        if head > sizes[-1]:
            return seconds[-1] * head / sizes[-1]
        return float(np.interp(head, sizes, seconds))

    def softmax_at(self, elements: float) -> float:
        """A softmax kernel's seconds per element over `elements` logits: softmax_by_size's,
        linear in log2 of the size between its rows and its end rows' beyond them; else
        softmax_element_s."""
        if not self.softmax_by_size:
            return self.softmax_element_s
        sizes, seconds = zip(*self.softmax_by_size)
        return float(np.interp(math.log2(max(elements, 1.0)), np.log2(sizes), seconds))

    @property
    def shares_cores(self) -> bool:
        """CPU ranks more than the cores they run on: a rank's rate depends on how many run."""
        return bool(self.cores_per_node) and self.gpus_per_node > self.cores_per_node

    def speedup(self, busy: int) -> float:
        """A rank's rate with `busy` of its node's ranks running over its rate with all of them
        running (what the rates are calibrated at): busy_speedup's where measured, else the
        cores' fair share; 1 where ranks do not share cores."""
        if not self.shares_cores:
            return 1.0
        busy = max(1, min(busy, self.gpus_per_node))
        if busy <= len(self.busy_speedup):
            return self.busy_speedup[busy - 1]
        return self.gpus_per_node / max(busy, self.cores_per_node)

    @classmethod
    def of(cls, preset: dict) -> "Cluster":
        """The cluster of a preset's fields (a calibration's extra keys, its measurements, left out)."""
        return cls(**{k: v for k, v in preset.items() if k in cls.__dataclass_fields__})

    def measured_all_reduce(self, members: int, nbytes: float) -> float | None:
        """Seconds of an all-reduce of nbytes over a line of `members` inside a node, as
        measured (all_reduce_s), or None where no line of that size was."""
        for g, fixed, per_byte in self.all_reduce_s:
            if g == members:
                return fixed + per_byte * nbytes
        return None


def load_cluster(name_or_path: str, gpus_per_node: int | None = None) -> Cluster:
    """A preset by name (clusters/NAME.json) or a JSON file of the same fields."""
    p = Path(name_or_path)
    if not p.exists():
        p = PRESETS / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(f.stem for f in PRESETS.glob("*.json"))
        raise GridError(f"unknown cluster {name_or_path!r}: use one of {known} or a JSON file path")
    d = json.loads(p.read_text())
    if gpus_per_node:
        d["gpus_per_node"] = gpus_per_node
    missing = {f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING} - set(d)
    if missing:
        raise GridError(f"cluster file {p} lacks {sorted(missing)}")
    return Cluster.of(d)
