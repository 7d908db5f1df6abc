"""Performance model and planner: predicted step time, memory and traffic of a grid.

Collectives are alpha-beta costed (ring, halving-doubling, pairwise, tree) over the links a
grid line actually uses under the engine's placement (cpp/placement.h): a line inside a node
uses the intra-node link; a line across nodes shares each node's network link with the
other lines leaving that node. A layer's collectives, GEMM calls and parameters are
recorded from the mode's own TransformerLayer run on meta tensors (modes/schedule.py), so
they are exactly what autograd executes (seed 003 1-D, SUMMA 2-D, seed 000 3-D, seed 004
ring, seed 002 split/join); the pipeline follows seed 001; compute follows seed 001 eq. (3);
memory the mixed-precision 20 phi (or AxoNN's 4 phi + 16 bsize) and the activations per layer.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from . import _C
from .errors import GridError
from .modes import Mode, Sequence, grid_axes, known
from .modes.schedule import collectives_at, layer_schedule

PRESETS = Path(__file__).parent / "clusters"


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
    fields = set(Cluster.__dataclass_fields__)
    missing = fields - set(d) - {"about", "vector_bandwidth_Bps", "launch_s", "nics_per_node"}
    if missing:
        raise GridError(f"cluster file {p} lacks {sorted(missing)}")
    return Cluster(**{k: v for k, v in d.items() if k in fields})  # extra keys (measurements) are kept out


@dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int  # global batch (sequences per step)
    vocab: int = 51200
    bytes_per_value: int = 2  # fp16/bf16 activations and gradients


# The keys of a model's sizes in Hugging Face configs (Llama-style first, GPT-2's after) and
# in gridweave's own (ModelConfig.to_dict: a run's index, an export's model_config.json).
_SIZE_KEYS = {"hidden": ("hidden_size", "n_embd", "hidden"), "layers": ("num_hidden_layers", "n_layer", "layers"),
              "heads": ("num_attention_heads", "n_head", "heads"), "vocab": ("vocab_size", "vocab"),
              "seq": ("max_position_embeddings", "n_positions", "seq")}


def model_from(source: str, batch: int, seq: int | None = None, **sizes) -> Model:
    """The planner's Model of a config: a Hugging Face config.json (or the folder holding it),
    a gridweave model config (a run folder's checkpoint index, an export's model_config.json),
    or "llama" / "gpt": the main job's model (gw.train.TrainConfig's defaults). seq defaults
    to the config's context length; `sizes` (hidden, layers, heads, vocab) override it. The
    planner's layer is the mode's TransformerLayer (4h MLP, as many kv heads as heads)."""
    if source in ("llama", "gpt"):
        from .train import TrainConfig

        c = TrainConfig(model=source).model_config(TrainConfig.vocab)
        found = {"hidden": c.hidden, "layers": c.layers, "heads": c.heads, "vocab": c.vocab, "seq": c.seq}
    else:
        p = Path(source)
        candidates = [p] if p.is_file() else [p / "config.json", p / "model_config.json",
                                               p / "checkpoint" / "latest"]
        path = next((c for c in candidates if c.exists()), None)
        if path is None:
            raise GridError(f"--model {source}: not 'llama', 'gpt', a config.json or a folder holding one")
        if path.name == "latest":  # a run folder: its newest checkpoint's index
            from .checkpoint import open_index

            d = open_index(p / "checkpoint")[1]["config"]["model"]
        else:
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise GridError(f"--model {path}: not a readable JSON config ({e})") from None
        found = {}
        for name, keys in _SIZE_KEYS.items():
            key = next((k for k in keys if isinstance(d.get(k), int)), None)
            if key is not None:
                found[name] = d[key]
    found.update({k: v for k, v in sizes.items() if v})
    if seq:
        found["seq"] = seq
    missing = [k for k in ("hidden", "layers", "heads", "seq") if k not in found]
    if missing:
        raise GridError(f"--model {source}: no {', '.join(missing)} in the config; pass --{' --'.join(missing)}")
    return Model(found["hidden"], found["layers"], found["heads"], found["seq"], batch, found.get("vocab", 51200))


def step_counters(schedule, axes: dict, placement, rank: int) -> dict:
    """The engine's traffic counters (gw.Grid.stats: ops, messages and bytes sent per axis label)
    that one step of `schedule` (modes.schedule.step_schedule for this rank's stage) leaves on
    `rank` of a grid of `axes` placed by `placement` (gw.Grid.placement or _C.Placement): each op's
    messages are the engine's own (_C.message_schedule), so equal counters mean the planner
    costs the algorithms that ran."""
    names, sizes = list(axes), dict(axes)
    out = {}
    for c, times in schedule.collectives:
        axes = names if c.axis == "world" else c.axis.split(",")
        g = math.prod(sizes[a] for a in axes)
        member = placement.index_in_line(rank, axes)
        sent = [b for _, b, send in _C.message_schedule(c.op, g, member, int(c.member_bytes), c.root, c.elem) if send]
        d = out.setdefault(c.axis, {"ops": 0, "sent_messages": 0, "sent_bytes": 0})
        d["ops"] += times
        d["sent_messages"] += times * len(sent)
        d["sent_bytes"] += times * sum(sent)
    return out


def explain(rows: list, n: int) -> list:
    """Why plan row n (0-based) ranks above row n+1: the parts of their step times and memory
    that differ, largest first, as lines of text."""
    if not 0 <= n < len(rows) - 1:
        raise GridError(f"--explain {n + 1}: choose a grid from 1 to {len(rows) - 1} (it is compared with the next)")
    a, b = rows[n], rows[n + 1]

    def name(r):
        return f"dp {r['dp']} x pp {r['pp']} x tp {r['tp']} x sp {r['sp']} ({r['placement']})"

    def parts(r):
        t = r["time_breakdown_s"]
        out = {"compute": t["compute"], "recomputation": t["recompute"], "pipeline bubble": t["bubble"]}
        out.update({f"communication on {k}": v for k, v in t["communication"].items()})
        return out

    pa, pb = parts(a), parts(b)
    diffs = sorted(((pb.get(k, 0.0) - pa.get(k, 0.0), k) for k in set(pa) | set(pb)), key=lambda d: -abs(d[0]))
    lines = [f"#{n + 1} {name(a)}: {a['step_time_s'] * 1e3:.2f} ms per step, {a['memory_bytes'] / 2 ** 30:.2f} GiB",
             f"#{n + 2} {name(b)}: {b['step_time_s'] * 1e3:.2f} ms per step, {b['memory_bytes'] / 2 ** 30:.2f} GiB"]
    if a.get("fits", True) != b.get("fits", True):
        lines.append(f"#{n + 2} does not fit in memory; #{n + 1} does")
    lines.append(f"#{n + 1} is {(b['step_time_s'] - a['step_time_s']) * 1e3:+.2f} ms faster; by part "
                 f"(#{n + 2} minus #{n + 1}):")
    for d, k in diffs:
        if abs(d) > 1e-12:
            lines.append(f"  {k:32s} {d * 1e3:+10.3f} ms")
    ma, mb = a["memory_breakdown_bytes"], b["memory_breakdown_bytes"]
    lines.append("memory per GPU (#" + f"{n + 2} minus #{n + 1}): " +
                 ", ".join(f"{k} {(mb[k] - ma[k]) / 2 ** 20:+.1f} MiB" for k in ma))
    return lines


# ---- alpha-beta costs ------------------------------------------------------------------


def collective_time(op: str, g: int, nbytes: float, link: tuple, cluster: Cluster, algorithm: str = "ring") -> float:
    """Seconds for one collective over g ranks. nbytes: the full buffer (all-gather output,
    reduce-scatter / all-reduce input, broadcast payload). link = (alpha, bandwidth)."""
    if g <= 1 or nbytes <= 0:
        return 0.0
    alpha, bw = link
    frac = (g - 1) / g
    if op in ("all_gather", "reduce_scatter"):
        if algorithm == "pairwise":
            return (g - 1) * alpha + frac * nbytes / bw
        steps = math.ceil(math.log2(g)) if algorithm == "halving_doubling" else g - 1
        return steps * alpha + frac * nbytes / bw
    if op == "all_reduce":
        steps = 2 * math.ceil(math.log2(g)) if algorithm == "halving_doubling" else 2 * (g - 1)
        return steps * alpha + 2 * frac * nbytes / bw
    if op == "all_to_all":
        return (g - 1) * alpha + frac * nbytes / bw
    if op in ("broadcast", "reduce"):  # pipelined: a chain (NCCL's ring) or a binomial tree
        steps = math.ceil(math.log2(g)) if algorithm == "tree" else g - 1
        return steps * alpha + nbytes / bw
    if op == "send":
        return alpha + nbytes / bw
    raise GridError(f"no cost model for {op!r}")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Seed 001 / 003: the pipeline's idle time relative to its busy time, (p-1)/m."""
    return (stages - 1) / microbatches


def transformer_flops(model: Model, recompute: bool = False) -> float:
    """Seed 001 eq. (3): 96 b s l h^2 (1 + s/6h + V/16lh) with activation recomputation,
    72 (...) without."""
    b, s, l, h, v = model.batch, model.seq, model.layers, model.hidden, model.vocab
    return (96 if recompute else 72) * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# ---- a grid ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridShape:
    """A candidate grid: degrees, the tensor mode object, and the placement policy."""
    dp: int = 1
    pp: int = 1
    tp: Mode = Sequence()
    sp: int = 1
    placement: str = "topology"

    def __post_init__(self):
        if not isinstance(self.tp, Mode):
            raise GridError(f"tp must be a mode object (gw.Row(n), gw.Cube(p), ...), got {self.tp!r}")
        for name in ("dp", "pp", "sp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise GridError(f"{name} must be a positive integer, got {v!r}")

    def tp_ranks(self) -> int:
        return self.tp.ranks()

    def axes(self):
        return grid_axes(self.dp, self.pp, self.sp, self.tp)


def _links(grid: GridShape, cluster: Cluster):
    """For each axis: (alpha, effective bandwidth, nodes a line spans, the share of its bytes
    that cross nodes), from the engine's placement and its SUPER traffic model (eqs. 4-7)."""
    placement = _C.Placement(grid.axes(), grid.placement, cluster.gpus_per_node)
    out = {}
    for name, size in grid.axes():
        if size == 1:
            continue
        line = placement.line(0, [name])
        nodes = {placement.node_of(r) for r in line}
        t = placement.traffic([name], "all_gather", 1 << 10)
        inter = t["inter_bytes"] / t["bytes"]
        if len(nodes) == 1:
            out[name] = (cluster.intra_alpha_s, cluster.intra_bandwidth_Bps, 1, inter)
        else:  # the node's network link is shared by every line leaving it
            here = sum(1 for r in line if placement.node_of(r) == 0)
            flows = max(1, min(placement.world_size, cluster.gpus_per_node) // max(here, 1))
            share = max(1, -(-flows // cluster.nics_per_node))
            out[name] = (cluster.inter_alpha_s, cluster.inter_bandwidth_Bps / share, len(nodes), inter)
    return out, placement


def layer_ops(model: Model, grid: GridShape, tokens: float) -> list:
    """One transformer layer's work on one rank for `tokens` tokens of its replica, forward and
    backward: ("gemm", flops, calls), ("vector", bytes, kernels) and (collective, axis, bytes),
    the collectives and GEMM calls as the mode's layer issues them (modes/schedule.py)."""
    h, s = model.hidden, model.seq
    mode = grid.tp
    flops = 72 * tokens * h * h * (1 + s / (6 * h)) / (mode.ranks() * grid.sp)  # seed 001 eq. (3), one layer
    # element-wise work: its bytes written forward, read and written backward; ~10 kernels
    # forward (2 layer norms, softmax, mask, GELU, residuals, biases) and twice that backward
    act = mode.activation_bytes(h, s, model.heads, tokens, grid.sp) * model.bytes_per_value / 2
    ops = [("vector", 3 * act, 30)]
    recorded = collectives_at(mode, h, model.heads, s, grid.sp, tokens / s)
    ops += [(c.op, c.axis, c.nbytes * model.bytes_per_value / 2) for c in recorded]  # recorded in bf16
    ops.append(("gemm", flops, layer_schedule(mode, h, model.heads, s, grid.sp)[0].gemm_calls))
    return ops


def predict(model: Model, grid: GridShape, cluster: Cluster, microbatches: int | None = None,
            offload_bsize: int | None = None, recompute: bool = False) -> dict:
    """Predicted step time (s), memory per GPU (bytes) and bytes per axis for one step."""
    h, s, L, e = model.hidden, model.seq, model.layers, model.bytes_per_value
    if model.batch % grid.dp:
        raise GridError(f"batch {model.batch} does not split over dp={grid.dp}")
    if L % grid.pp:
        raise GridError(f"{L} layers do not split over pp={grid.pp}")
    b = model.batch // grid.dp  # sequences per data-parallel replica
    m = microbatches or (min(b, 4 * grid.pp) if grid.pp > 1 else 1)
    links, _ = _links(grid, cluster)
    sizes = dict(grid.axes())
    layers_here = L // grid.pp
    tokens = b * s / m  # tokens of one micro-batch of this replica
    per_axis = {}
    busy = [0.0]  # compute (GEMMs and element-wise work) inside seconds(), for the breakdown

    def seconds(ops, repeat):
        """Time of `ops` done `repeat` times; each collective's bytes and time go to its axis."""
        t = 0.0
        for op in ops:
            if op[0] == "gemm":
                c = op[1] / cluster.gemm_flops + op[2] * cluster.launch_s
                busy[0] += c * repeat
                t += c
            elif op[0] == "vector":
                c = (op[1] / cluster.vector_bandwidth_Bps if cluster.vector_bandwidth_Bps else 0.0) + \
                    op[2] * cluster.launch_s
                busy[0] += c * repeat
                t += c
            elif op[1] in links:
                a, bw = links[op[1]][:2]
                c = cluster.launch_s + collective_time(op[0], sizes[op[1]], op[2], (a, bw), cluster)
                acc = per_axis.setdefault(op[1], [0.0, 0.0])
                acc[0] += c * repeat
                acc[1] += op[2] * repeat
                t += c
        return t * repeat

    ops = layer_ops(model, grid, tokens)
    stage = seconds(ops, layers_here)  # one micro-batch through a stage
    if recompute:  # each layer's forward again in backward: a third of its GEMM and element-wise work
        redo = [(op[0], op[1] / 3, op[2] / 3) for op in ops if op[0] in ("gemm", "vector")]
        before = busy[0]
        stage += seconds(redo, layers_here)
        recompute_s = (busy[0] - before) * m
    else:
        recompute_s = 0.0
    if model.vocab:  # the logits on the last stage (seed 001 eq. (3)'s V / 16lh term), over the tensor ranks
        head = 72 * tokens * h * model.vocab / 16 / (grid.tp_ranks() * grid.sp) / cluster.gemm_flops
        busy[0] += head
        stage += head
    if grid.pp > 1:  # activations forward and gradients backward at each stage boundary
        act = tokens / grid.sp * h * e * grid.tp.boundary_fraction()
        stage += seconds([("send", "pp", act), ("send", "pp", act)], 1)
    bubble = bubble_fraction(grid.pp, m) if grid.pp > 1 else 0.0
    pipeline = m * stage * (1 + bubble)  # (m + p - 1) micro-batch slots
    for k in per_axis:  # the per-axis figures so far are for one micro-batch
        per_axis[k] = [v * m for v in per_axis[k]]
    compute_busy = busy[0] * m - recompute_s
    phi = 12 * L * h * h + model.vocab * h
    # the layer's parameters this rank holds, as its modules place them (recorded)
    layer_local = layer_schedule(grid.tp, h, model.heads, s, grid.sp)[0].parameters
    phi_local = layer_local * L / grid.pp + model.vocab * h
    step = pipeline + seconds([("all_reduce", "dp", phi_local * e)], 1)
    compute = (transformer_flops(model, recompute) / (grid.dp * grid.pp * grid.tp_ranks() * grid.sp)
               / cluster.gemm_flops)

    # memory per GPU: weights, gradients and Adam (20 phi mixed precision, or AxoNN's 4 phi + 16 bsize)
    # parameters and gradients in half precision, 2 + 2 bytes; fp32 master, exp_avg, exp_avg_sq
    # and the fp32 gradient, 16 bytes: all here, or AxoNN's bsize-element buckets on the GPU
    optimizer = 16 * offload_bsize if offload_bsize else 16 * phi_local
    state = 4 * phi_local + optimizer
    act_layer = grid.tp.activation_bytes(h, s, model.heads, tokens, grid.sp) * e / 2
    in_flight = min(m, grid.pp)
    act = (2 * tokens / grid.sp * h * layers_here + act_layer) * in_flight if recompute else \
        act_layer * layers_here * in_flight
    return {**{k: v for k, v in asdict(grid).items() if k != "tp"}, "tp": grid.tp.spec(),
            "step_time_s": step, "compute_s": compute, "bubble": bubble, "microbatches": m,
            "memory_bytes": state + act, "parameters": phi,
            # where the step time goes (they add up to step_time_s) and the memory (to memory_bytes)
            "time_breakdown_s": {"compute": compute_busy, "recompute": recompute_s,
                                 "communication": {k: v[0] for k, v in per_axis.items()},
                                 "bubble": pipeline - pipeline / (1 + bubble)},
            "memory_breakdown_bytes": {"parameters": 2 * phi_local, "gradients": 2 * phi_local,
                                       "optimizer": optimizer, "activations": act},
            "bytes_per_axis": {k: {"intra": v[1] * (1 - links[k][3]), "inter": v[1] * links[k][3]}
                               for k, v in per_axis.items()},
            "seconds_per_axis": {k: v[0] for k, v in per_axis.items()},
            "axis_links": {k: ("intra" if v[2] == 1 else f"inter ({v[2]} nodes)") for k, v in links.items()}}


def tensor_modes(n: int, model: Model) -> list:
    """Every tensor mode of at most n ranks that the model's sizes split over, asked of each
    registered mode class that takes part in planning (Mode.planned)."""
    out = []
    for cls in known():
        if not cls.planned:
            continue
        if not cls.size_arg:
            out.append(cls())
            continue
        for size in range(2, n + 1):
            m = cls(size)
            if m.ranks() > n:
                break
            if n % m.ranks() == 0 and m.accepts(model.heads, model.hidden):
                out.append(m)
    return out


# Sequence-parallel degrees are considered while each rank keeps at least this many tokens:
# below it the ring's per-step latency dwarfs its blocks (Megatron-LM's context parallelism
# and seed 004 use thousands per rank), and every ring step costs the recording a step too.
MIN_TOKENS_PER_SP_RANK = 64


def enumerate_grids(n: int, model: Model, placements=("topology", "naive")):
    """Every grid of n ranks the model's sizes allow."""
    out = []
    for mode in tensor_modes(n, model):
        rest = n // mode.ranks()
        for sp in (d for d in range(1, rest + 1) if rest % d == 0 and model.seq % (2 * d) == 0
                   and (d == 1 or model.seq // d >= MIN_TOKENS_PER_SP_RANK)):
            for pp in (d for d in range(1, rest // sp + 1) if (rest // sp) % d == 0 and model.layers % d == 0):
                dp = rest // (sp * pp)
                if model.batch % dp:
                    continue
                for pl in placements:
                    out.append(GridShape(dp=dp, pp=pp, tp=mode, sp=sp, placement=pl))
    return out


def best_microbatching(model: Model, grid: GridShape, cluster: Cluster, sizes=(1, 2, 4, 8, 16), **kw) -> dict:
    """predict() at the micro-batch size (sequences per micro-batch, Megatron's
    --micro-batch-size) that is fastest among those that fit in memory, else the smallest."""
    b = model.batch // grid.dp if grid.dp and model.batch % grid.dp == 0 else 0
    rows = [predict(model, grid, cluster, microbatches=b // mbs, **kw) for mbs in sizes if b and b % mbs == 0]
    if not rows:
        return predict(model, grid, cluster, **kw)
    fits = [r for r in rows if r["memory_bytes"] <= cluster.memory_bytes]
    return min(fits, key=lambda r: r["step_time_s"]) if fits else min(rows, key=lambda r: r["memory_bytes"])


def plan(n: int, model: Model, cluster: Cluster, top: int | None = None, **kw) -> list:
    """Grids ranked by predicted step time, the ones that fit in memory first; of two
    placements that predict the same, the first."""
    rows = []
    for g in enumerate_grids(n, model):
        try:
            rows.append(best_microbatching(model, g, cluster, **kw))
        except GridError:
            continue
    seen, unique = set(), []
    for r in rows:  # a placement that changes nothing (one node) is listed once
        key = (r["dp"], r["pp"], r["tp"], r["sp"], r["step_time_s"], r["memory_bytes"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique
    for r in rows:
        r["fits"] = r["memory_bytes"] <= cluster.memory_bytes
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"]))
    return rows[:top] if top else rows
