"""Every grid of n ranks a model splits over, predicted (in worker processes for large plans) and
ranked; the table's columns and folding; why one grid ranks above the next."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

from .. import pipeline
from ..errors import GridError
from ..models import ModelConfig
from ..modes import known
from .cluster import Cluster
from .predict import _check_recompute, predict
from .shape import GridShape, Model, PLACEMENTS


def explain(rows: list, n: int) -> list:
    """Why plan row n (0-based) ranks above row n+1: the parts of their step times and memory
    that differ, largest first, as lines of text."""
    if not 0 <= n < len(rows) - 1:
        raise GridError(f"explain: row {n} (0-based) has no next row to compare with; "
                        f"n goes from 0 to {len(rows) - 2}")
    a, b = rows[n], rows[n + 1]

    def name(r):
        zero = f", zero {r['zero']}" if r.get("zero") else ""
        return f"dp {r['dp']} x pp {r['pp']} x tp {r['tp']} x sp {r['sp']} ({r['placement']}{zero})"

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
            if n % m.ranks() == 0 and m.accepts(model.heads, model.hidden, model.config.arch.kv(model.heads)):
                out.append(m)
    return out


# Sequence-parallel degrees are considered while each rank keeps at least this many tokens:
# below it the ring's per-step latency dwarfs its blocks (Megatron-LM's context parallelism
# and Li et al. use thousands per rank), and every ring step costs the recording a step too.
MIN_TOKENS_PER_SP_RANK = 64


def _accepted(grid: GridShape, model: Model) -> bool:
    """Whether train accepts the grid at the fewest micro-batches its schedule runs (one, or a
    table's least: DualPipeV's 2 pp)."""
    for m in (1, 2 * grid.pp) if grid.schedule in pipeline.TABLES else (1,):
        try:
            grid.check(model, m)
        except GridError:
            continue
        return True
    return False


def enumerate_grids(n: int, model: Model, placements=PLACEMENTS, zeros=(0, 1, 2, 3),
                    min_sp_tokens: int = MIN_TOKENS_PER_SP_RANK, schedules=(pipeline.AUTO,)):
    """Every grid of n ranks that `gridweave train` accepts for the model (GridShape.check, train's
    rule; the planner adds only its floor of min_sp_tokens tokens per sequence-parallel rank), at
    each ZeRO stage where it has data axes, with each of `schedules` where it has pipeline stages
    (auto: pipeline.resolve_schedule, 1F1B's fixed order where a micro-batch needs it; zbv and
    dualpipev with their 2 chunks a stage); a mixture of experts at every expert-parallel degree."""
    out = []
    for mode in tensor_modes(n, model):
        rest = n // mode.ranks()
        for sp in (d for d in range(1, rest + 1) if rest % d == 0
                   and (d == 1 or model.seq // d >= min_sp_tokens)):
            for pp in (d for d in range(1, rest // sp + 1) if (rest // sp) % d == 0):
                dp = rest // (sp * pp)
                # a mixture of experts: every expert-parallel degree its experts and dp x sp split into
                eps = (1,) if model.config.moe is None else \
                    [e for e in range(1, dp * sp + 1) if (dp * sp) % e == 0 and model.config.moe.experts % e == 0]
                scheds = schedules if pp > 1 else (pipeline.AUTO,)
                for sched, pl, zero, ep in itertools.product(scheds, placements, zeros if dp * sp > 1 else (0,), eps):
                    try:
                        grid = GridShape(dp=dp, pp=pp, tp=mode, sp=sp, placement=pl, zero=zero, ep=ep, schedule=sched,
                                         chunks=2 if sched in pipeline.V_SCHEDULES else 1)
                    except GridError:
                        continue
                    if _accepted(grid, model):
                        out.append(grid)
    return out


def microbatch_counts(model: Model, grid: GridShape, sizes=(1, 2, 4, 8, 16)) -> list:
    """The micro-batch counts of the micro-batch sizes (sequences per micro-batch, Megatron's
    --micro-batch-size) that `gridweave train` accepts on this grid (GridShape.check); where it
    accepts none of `sizes` (a mode that splits each micro-batch's rows over many ranks), the
    smallest size it accepts."""
    b = model.batch // grid.dp if grid.dp and model.batch % grid.dp == 0 else 0

    def accepted(mbs):
        try:
            grid.check(model, b // mbs)
        except GridError:
            return False
        return True

    out = [b // mbs for mbs in sizes if b and b % mbs == 0 and accepted(mbs)]
    if not out and b:
        out = [b // mbs for mbs in range(1, b + 1) if b % mbs == 0 and accepted(mbs)][:1]
    return out


def best_microbatching(model: Model, grid: GridShape, cluster: Cluster, sizes=(1, 2, 4, 8, 16), **kw) -> dict:
    """predict() at the micro-batch size (sequences per micro-batch, Megatron's
    --micro-batch-size) that is fastest among those train accepts and that fit in memory, else
    the smallest in memory. A GridError when train accepts none of them."""
    counts = microbatch_counts(model, grid, sizes)
    if not counts:
        grid.check(model, 1)  # its reason
        raise GridError(f"no micro-batch size of {sizes} splits the batch of {model.batch} on {grid.spec()}")
    rows = [predict(model, grid, cluster, microbatches=m, **kw) for m in counts]
    fits = [r for r in rows if r["memory_bytes"] <= cluster.memory_bytes]
    return min(fits, key=lambda r: r["step_time_s"]) if fits else min(rows, key=lambda r: r["memory_bytes"])


def _predicted(grids: list, model: Model, cluster: Cluster, microbatches: int | None, kw: dict) -> list:
    """plan's rows of `grids` (those train accepts), in their order."""
    rows = []
    for g in grids:
        try:
            rows.append(predict(model, g, cluster, microbatches=microbatches, **kw) if microbatches
                        else best_microbatching(model, g, cluster, **kw))
        except GridError:
            continue
    return rows


def _in_workers(grids: list, model: Model, cluster: Cluster, microbatches: int | None, kw: dict, workers: int) -> list:
    """_predicted over `workers` processes (python -m gridweave._plan_worker), each given runs of
    GRIDS_PER_TASK consecutive grids, run i to worker i mod workers, as JSON (grids as their specs);
    the rows taken back in the grids' order. Each worker is its own Python (spawned, not forked:
    a fork would inherit torch's thread pools mid-state)."""
    import subprocess
    import sys
    import tempfile

    runs = [[g.spec() for g in grids[i:i + GRIDS_PER_TASK]] for i in range(0, len(grids), GRIDS_PER_TASK)]
    job = {"model": dataclasses.asdict(model), "cluster": dataclasses.asdict(cluster), "microbatches": microbatches,
           "kw": kw}
    texts = [json.dumps(dict(job, runs=runs[w::workers])) for w in range(workers)]  # bad options fail here
    done, failed = [None] * len(runs), []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for w, text in enumerate(texts):  # outputs to files: no pipe fills while another worker is read
                out, err = (open(Path(tmp) / f"{w}.{k}", "w+") for k in ("out", "err"))
                procs.append((subprocess.Popen([sys.executable, "-m", "gridweave._plan_worker"], stdin=subprocess.PIPE,
                                               stdout=out, stderr=err, text=True), out, err))
                procs[-1][0].stdin.write(text)
                procs[-1][0].stdin.close()
            for w, (p, out, err) in enumerate(procs):
                p.wait()  # no timeout: a worker only computes (no peer to wait for) and ends with its runs
                out.seek(0)
                err.seek(0)
                if p.returncode != 0:
                    failed.append(f"worker {w} exited {p.returncode}: {err.read().strip()[-2000:]}")
                else:
                    done[w::workers] = json.load(out)["rows"]
        finally:  # an error here (or ^C) leaves no worker behind
            for p, out, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out.close()
                err.close()
    if failed:
        raise GridError("plan's workers failed: " + "; ".join(failed))
    return [r for run in done for r in run]


def _worker_main(job: dict) -> dict:
    """_plan_worker's job: {"model", "cluster", "microbatches", "kw", "runs": lists of grid specs}
    -> {"rows": _predicted's rows of each run}."""
    m = dict(job["model"])
    model = Model(ModelConfig(**m.pop("config")), **m)
    cluster = Cluster(**job["cluster"])
    return {"rows": [_predicted([GridShape.parse(s) for s in run], model, cluster, job["microbatches"], job["kw"])
                     for run in job["runs"]]}


# Grids a worker process takes at a time: consecutive grids share their recordings (the same
# mode, sp and pp under the other placement and ZeRO stages), so a worker keeps them together.
GRIDS_PER_TASK = 256
RUNS_PER_WORKER = 1  # the fewest runs worth a worker (it takes seconds to start: torch's import)


def plan(n: int, model: Model, cluster: Cluster, top: int | None = None, microbatches: int | None = None,
         workers: int | None = None, schedules=(pipeline.AUTO,), **kw) -> list:
    """Grids (with their ZeRO stage) ranked by predicted step time, the ones that fit in memory
    first, then by memory; of two placements that predict the same, the first. microbatches: the
    job's count (default: the fastest micro-batch size that fits, per grid). workers: processes that predict the grids
    (consecutive runs of GRIDS_PER_TASK each, the rows taken back in order: the same ranking as one
    process); None: one per core this process may use, as long as each has RUNS_PER_WORKER runs
    (a worker takes seconds to start and holds its own recordings), else this process alone.
    schedules: the pipeline schedules ranked on grids with stages (enumerate_grids)."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise GridError(f"workers must be a positive integer (or None: one per core), got {workers!r}")
    _check_recompute(kw.get("recompute", False))  # predict's GridErrors below only skip a grid
    grids = enumerate_grids(n, model, schedules=schedules)
    tasks = -(-len(grids) // GRIDS_PER_TASK)
    if workers is None:
        workers = max(1, min(len(os.sched_getaffinity(0)), tasks // RUNS_PER_WORKER))
    if workers == 1:
        rows = _predicted(grids, model, cluster, microbatches, kw)
    else:
        rows = _in_workers(grids, model, cluster, microbatches, kw, workers)
    seen, unique = set(), []
    for r in rows:  # a placement that changes nothing (one node) is listed once
        key = (r["dp"], r["pp"], r["tp"], r["sp"], r["zero"], r["schedule"], r["step_time_s"], r["memory_bytes"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique
    for r in rows:
        r["fits"] = r["memory_bytes"] <= cluster.memory_bytes
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"], r["memory_bytes"]))  # equal speed: less memory
    return rows[:top] if top else rows


# The ranking table's columns (gridweave plan's text output, its --help and the planner guide).
TABLE_COLUMNS = {
    "#": "the grid's place: grids that fit the memory first, then by predicted step time, then by memory",
    "dp": "data-parallel replicas", "pp": "pipeline stages",
    "tp": "the tensor-parallel mode and its size (none, row:n Megatron 1-D, square:n SUMMA, cube:n 3-D, "
          "subgraph:n SUPER)",
    "sp": "sequence-parallel ranks", "ep": "the ranks each mixture-of-experts layer's experts split over",
    "zero": "the ZeRO stage (0: each replica keeps the whole optimizer state)",
    "placement": "how the grid's axes map to nodes", "schedule": "the pipeline schedule",
    "mb": "micro-batches a step (each replica's batch split into this many)",
    "step ms": "predicted time a step", "compute": "forward, backward and recomputation (ms)",
    "bubble": "pipeline idle time (ms)", "comm per axis ms": "communication not hidden, per grid axis",
    "mem GiB": "predicted device memory per rank", "(param/grad/optim/act)": "its parts (GiB)",
}
FOLDED = ("zero", "placement", "schedule")  # a row's values that can fold when they change nothing
SHOWN = ("dp", "pp", "tp", "sp", "ep", "zero", "placement", "schedule", "microbatches")


def fold_equal(rows: list) -> list:
    """The ranking as the table shows it: rows that differ in one of FOLDED only, with equal step time
    and memory (ZeRO 1 and 2 without gradients to drop, a placement that changes nothing), as one row
    at the first one's place, its field listing the values ("1|2"). rows: plan()'s, left as they are."""
    for field in FOLDED:
        kept, at = [], {}
        for r in rows:
            key = tuple(r[k] for k in SHOWN if k != field) + (r["step_time_s"], r["memory_bytes"])
            if key in at:
                first = kept[at[key]]
                values = set(str(first[field]).split("|")) | {str(r[field])}
                kept[at[key]] = {**first, field: "|".join(sorted(values))}  # sorted: folds compare alike
                continue
            at[key] = len(kept)
            kept.append(r)
        rows = kept
    return rows
