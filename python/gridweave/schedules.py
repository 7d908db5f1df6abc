"""Pipeline schedules as tables: each stage's operations in the order it runs them, F (a
micro-batch's forward through one model chunk), BW (its whole backward), or B (the backward for
the chunk's input: on the critical path) and W (for its weights: deferrable), after Qi et al.,
"Zero Bubble Pipeline Parallelism" (ICLR 2024). One table feeds what runs a schedule, what checks
it, and what predicts its bubble and memory (simulate, peaks), so the three cannot disagree.

Chunk c of stage s is virtual stage c * p + s ("loop": Megatron's interleaving) or, in a V, chunk
0 on s and chunk 1 on 2p - 1 - s ("v": ZB-V's and DualPipeV's placement)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from .errors import GridError


class Kind(enum.Enum):
    F = "F"    # forward
    B = "B"    # backward for the input
    W = "W"    # backward for the weights
    BW = "BW"  # the whole backward (B then W at once)


class Op(NamedTuple):
    kind: Kind
    chunk: int
    mb: int


class Placement(enum.Enum):
    LOOP = "loop"
    V = "v"


@dataclass(frozen=True)
class Table:
    """name, p stages, m micro-batches, chunks a stage and their placement; ops[s]: stage s's ops."""
    name: str
    stages: int
    microbatches: int
    chunks: int
    placement: Placement
    ops: tuple

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage (its place in the model, from the input) of `chunk` on `stage`."""
        p = self.stages
        if self.placement is Placement.V:
            return stage if chunk == 0 else 2 * p - 1 - stage
        return chunk * p + stage

    def stage_of(self, virtual: int) -> int:
        """The stage that holds a virtual stage."""
        p = self.stages
        if self.placement is Placement.V:
            return virtual if virtual < p else 2 * p - 1 - virtual
        return virtual % p

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks


def _check(p: int, m: int, chunks: int = 1) -> None:
    for name, v, least in (("stages", p, 2), ("microbatches", m, 1), ("chunks", chunks, 1)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            raise GridError(f"a pipeline schedule needs {name} >= {least}, got {v!r}")


def one_f_one_b(p: int, m: int) -> Table:
    """1F1B (PipeDream-Flush, Megatron-LM): stage s warms up with p - 1 - s forwards, then
    alternates a forward and a whole backward, then drains the backwards."""
    _check(p, m)
    ops = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        mine = [Op(Kind.F, 0, i) for i in range(warm)]
        for i in range(m - warm):
            mine += [Op(Kind.F, 0, warm + i), Op(Kind.BW, 0, i)]
        mine += [Op(Kind.BW, 0, i) for i in range(m - warm, m)]
        ops.append(tuple(mine))
    return Table("1f1b", p, m, 1, Placement.LOOP, tuple(ops))


def interleaved(p: int, m: int, v: int) -> Table:
    """Megatron-LM's interleaved 1F1B (Fig. 4), in the order cpp/pipeline.cpp's run_interleaved
    runs it: the k-th forward is micro-batch (k // (p v)) p + k % p of chunk (k // p) % v, the
    k-th backward the same micro-batch of the chunks in reverse; stage s warms up with
    2 (p - 1 - s) + (v - 1) p forwards."""
    _check(p, m, v)
    if m % p:
        raise GridError(f"the interleaved schedule needs a multiple of the {p} stages as micro-batches, got {m}")
    total = m * v

    def mb_of(k):
        return (k // (p * v)) * p + k % p

    ops = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        mine = [Op(Kind.F, (k // p) % v, mb_of(k)) for k in range(warm)]
        for f in range(warm, total):
            b = f - warm
            mine += [Op(Kind.F, (f // p) % v, mb_of(f)), Op(Kind.BW, v - 1 - (b // p) % v, mb_of(b))]
        mine += [Op(Kind.BW, v - 1 - (b // p) % v, mb_of(b)) for b in range(total - warm, total)]
        ops.append(tuple(mine))
    return Table("interleaved", p, m, v, Placement.LOOP, tuple(ops))


def zb_h1(p: int, m: int) -> Table:
    """ZB-H1 (Qi et al. §3.1): 1F1B with each backward split into B and W; stage s runs the W
    of its oldest pending B from its s-th steady step on (the later a stage, the longer it defers
    W, the sooner its B reaches the stages before it), and drains B then W. Its peak activations
    (forwards not yet through W) stay at 1F1B's stage 0's, p micro-batches."""
    _check(p, m)
    ops = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        mine = [Op(Kind.F, 0, i) for i in range(warm)]
        pending = []
        for j in range(m - warm):
            mine += [Op(Kind.F, 0, warm + j), Op(Kind.B, 0, j)]
            pending.append(j)
            if j >= s:
                mine.append(Op(Kind.W, 0, pending.pop(0)))
        for i in range(m - warm, m):
            mine.append(Op(Kind.B, 0, i))
            pending.append(i)
            mine.append(Op(Kind.W, 0, pending.pop(0)))
        mine += [Op(Kind.W, 0, i) for i in pending]
        ops.append(tuple(mine))
    return Table("zb1", p, m, 1, Placement.LOOP, tuple(ops))


def zbv(p: int, m: int) -> Table:
    """ZB-V (Qi et al. §4): two chunks a stage in a V (chunk 0 on stage s, chunk 1 on 2p - 1 - s,
    so stage 0 holds both the first and the last virtual stage), each backward split into B and
    W. Stage r: 2 (p - r) - 1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); p - r triples
    (F, B, W of chunk 1); then the steady (F, B, W of chunk 0, F, B, W of chunk 1) while forwards
    remain; then r pairs (B chunk 0, B chunk 1), p - r pairs (B, W of chunk 0), and the Ws left,
    chunk 1's first. Made for max(2p - 1, m) micro-batches, those past m left out. Near zero
    bubble at 1F1B's peak memory (2p chunk activations: p micro-batches) for m >= 2p."""
    _check(p, m)
    n = max(2 * p - 1, m)
    ops = []
    for r in range(p):
        taken, mine = {}, []

        def emit(kind, c):  # the next micro-batch of this kind on chunk c
            i = taken.get((kind, c), 0)
            taken[(kind, c)] = i + 1
            if i < m:
                mine.append(Op(kind, c, i))

        for _ in range(2 * (p - r) - 1):
            emit(Kind.F, 0)
        for _ in range(r):
            emit(Kind.F, 1)
            emit(Kind.F, 0)
        for _ in range(p - r):
            for kind in (Kind.F, Kind.B, Kind.W):
                emit(kind, 1)
        while taken.get((Kind.F, 0), 0) < n or taken.get((Kind.F, 1), 0) < n:
            for c in (0, 1):
                for kind in (Kind.F, Kind.B, Kind.W):
                    emit(kind, c)
        for _ in range(r):
            emit(Kind.B, 0)
            emit(Kind.B, 1)
        for _ in range(p - r):
            emit(Kind.B, 0)
            emit(Kind.W, 0)
        for c in (1, 0):
            while taken.get((Kind.W, c), 0) < n:
                emit(Kind.W, c)
        ops.append(tuple(mine))
    return Table("zbv", p, m, 2, Placement.V, tuple(ops))


def dualpipev(p: int, m: int) -> Table:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, as torch.distributed.pipelining's
    ScheduleDualPipeV orders it): the V placement of ZB-V; in its steady phase each forward of one
    chunk pairs with the whole backward of the other (run one after the other here: overlapping
    them needs two streams), and B and W part only in the drain, where a W fills each gap. Stage
    r: 2 (p - r - 1) forwards of chunk 0; r + 1 pairs (F chunk 0, F chunk 1); p - r - 1 of (B
    chunk 1, a pending W, F chunk 1); m - 2p + r + 1 rounds of (F chunk 0 + BW chunk 1, F chunk 1
    + BW chunk 0); p - r - 1 of (BW chunk 1, F chunk 1 + BW chunk 0); r + 1 pairs of backwards
    (chunk 1, chunk 0), split into B from the middle one on; p - r - 1 of (a pending W, chunk 0's
    backward); the pending Ws. Needs m >= 2p."""
    _check(p, m)
    if m < 2 * p:
        raise GridError(f"DualPipeV needs at least twice the {p} stages as micro-batches, got {m}")
    ops = []
    for r in range(p):
        taken, pending, mine = {}, [], []

        def run(kind, c):  # the next micro-batch of this kind on chunk c (BW takes B's and W's turn)
            key = Kind.B if kind is Kind.BW else kind
            i = taken.get((key, c), 0)
            mine.append(Op(kind, c, i))
            taken[(key, c)] = i + 1
            if kind is Kind.B:
                pending.append((c, i))

        def a_pending_w():
            if pending:
                c, i = pending.pop(0)
                mine.append(Op(Kind.W, c, i))

        for _ in range(2 * (p - r - 1)):
            run(Kind.F, 0)
        for _ in range(r + 1):
            run(Kind.F, 0)
            run(Kind.F, 1)
        for _ in range(p - r - 1):
            run(Kind.B, 1)
            a_pending_w()
            run(Kind.F, 1)
        for _ in range(m - 2 * p + r + 1):
            run(Kind.F, 0)
            run(Kind.BW, 1)
            run(Kind.F, 1)
            run(Kind.BW, 0)
        for _ in range(p - r - 1):
            run(Kind.BW, 1)
            run(Kind.F, 1)
            run(Kind.BW, 0)
        split = False
        for i in range(r + 1):  # from the middle pair on (odd stages: before chunk 1's), B and W apart
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            run(Kind.B if split else Kind.BW, 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            run(Kind.B if split else Kind.BW, 0)
        for _ in range(p - r - 1):
            a_pending_w()
            run(Kind.B if split else Kind.BW, 0)
        while pending:
            a_pending_w()
        ops.append(tuple(mine))
    return Table("dualpipev", p, m, 2, Placement.V, tuple(ops))


def validate(t: Table) -> None:
    """Every (chunk, micro-batch) of every stage runs F once and then either BW once or B then W
    once each; one clear error otherwise."""
    for s, ops in enumerate(t.ops):
        seen = {}
        for op in ops:
            if not (0 <= op.chunk < t.chunks and 0 <= op.mb < t.microbatches):
                raise GridError(f"schedule {t.name}: stage {s} runs {op.kind.value} of chunk {op.chunk}, micro-batch "
                                f"{op.mb}: out of its {t.chunks} chunk(s) and {t.microbatches} micro-batches")
            done = seen.setdefault((op.chunk, op.mb), [])
            need = {Kind.F: [], Kind.BW: [Kind.F], Kind.B: [Kind.F], Kind.W: [Kind.F, Kind.B]}[op.kind]
            if done != need:
                raise GridError(f"schedule {t.name}: stage {s} runs {op.kind.value} of chunk {op.chunk}, micro-batch "
                                f"{op.mb} after {[k.value for k in done] or 'nothing'}")
            done.append(op.kind)
        for c in range(t.chunks):
            for mb in range(t.microbatches):
                if seen.get((c, mb)) not in ([Kind.F, Kind.BW], [Kind.F, Kind.B, Kind.W]):
                    raise GridError(f"schedule {t.name}: stage {s} does not run chunk {c}, micro-batch {mb} "
                                    f"through (it runs {[k.value for k in seen.get((c, mb), [])]})")


@dataclass(frozen=True)
class Timeline:
    """A simulated step: its span, each stage's busy time and idle fraction (the bubble), and
    each op's (start, end) by stage."""
    span: float
    busy: tuple
    times: tuple

    @property
    def bubbles(self) -> tuple:
        return tuple(1 - b / self.span for b in self.busy)

    @property
    def bubble(self) -> float:
        """The stages' idle time over their span: sum(idle) / (p * span)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.span)


def _dependency(t: Table, s: int, op: Op):
    """What op of stage s waits for: a forward the previous virtual stage's forward of its
    micro-batch, a backward the next virtual stage's backward (the last virtual stage's its own
    forward), a W nothing (it follows its own B on this stage: validate); None: nothing."""
    v = t.virtual(s, op.chunk)
    if op.kind is Kind.F:
        return None if v == 0 else ("F", v - 1, op.mb)
    if op.kind in (Kind.B, Kind.BW):
        return ("F", v, op.mb) if v == t.virtual_stages - 1 else ("B", v + 1, op.mb)
    return None


def _ready(t: Table, s: int, dep, end: dict, t_msg: float) -> float:
    """When what stage s waits for (dep, ended) is there: t_msg after it ended on another stage."""
    return 0.0 if dep is None else end[dep] + (t_msg if t.stage_of(dep[1]) != s else 0.0)


def _ended(t: Table, s: int, op: Op, end: dict, at: float) -> None:
    """Records op of stage s ended `at` (a W is waited for by nothing); B stands for BW too."""
    if op.kind is not Kind.W:
        end[("F" if op.kind is Kind.F else "B", t.virtual(s, op.chunk), op.mb)] = at


def _stuck(t: Table, place: list) -> GridError:
    """The clear error of a table whose every stage waits on another."""
    stuck = ", ".join(f"stage {s} at {t.ops[s][place[s]].kind.value}(chunk {t.ops[s][place[s]].chunk}, mb "
                      f"{t.ops[s][place[s]].mb})" for s in range(t.stages) if place[s] < len(t.ops[s]))
    return GridError(f"schedule {t.name} cannot run: every stage waits on another ({stuck})")


def _per_stage(x, stages: int) -> tuple:
    """One op kind's seconds on each stage: x itself, or x's for every stage."""
    x = tuple(x) if isinstance(x, (tuple, list)) else (x,) * stages
    if len(x) != stages:
        raise GridError(f"a simulated schedule of {stages} stages needs one op time per stage, got {len(x)}")
    return x


def simulate(t: Table, t_f=1.0, t_b=1.0, t_w=1.0, t_msg: float = 0.0, speed=None, waiting=0.0) -> Timeline:
    """Each stage runs its ops in order, an op as soon as what it needs has arrived: a forward the
    previous virtual stage's forward of its micro-batch (t_msg later), a backward the next virtual
    stage's backward (the last virtual stage's its own forward). BW takes t_b + t_w. t_f, t_b,
    t_w: an op's seconds, or each stage's (a tuple: stages that hold the embedding or the head
    take longer). speed: where the stages share what they run on (ranks sharing cores), each
    running op's rate (its seconds' worth per second) as a function of how many stages run at
    once: the ops progress together (processor sharing) and a stage alone runs faster. waiting:
    with speed, the share of each stage's op seconds (one, or each stage's) its messages spend on
    the wire, which goes at one second a second however few run: a link's latency is not a
    core's work. One clear error where the table cannot run (a stage would wait on an op that
    waits on it)."""
    validate(t)
    f, b, w, u = (_per_stage(x, t.stages) for x in (t_f, t_b, t_w, waiting))
    if any(not 0.0 <= x <= 1.0 for x in u):
        raise GridError(f"waiting is a share of each op's seconds, in [0, 1]; got {u}")
    cost = [{Kind.F: f[s], Kind.B: b[s], Kind.W: w[s], Kind.BW: b[s] + w[s]} for s in range(t.stages)]
    if speed is not None:
        return _shared(t, cost, t_msg, speed, u)
    end = {}  # (kind F or B, virtual stage, mb) -> when it ended (_ended)
    place = [0] * t.stages  # each stage's next op
    free = [0.0] * t.stages
    busy = [0.0] * t.stages
    times = [[] for _ in range(t.stages)]
    remaining = sum(len(o) for o in t.ops)
    while remaining:
        progressed = False
        for s in range(t.stages):
            while place[s] < len(t.ops[s]):
                op = t.ops[s][place[s]]
                dep = _dependency(t, s, op)
                if dep is not None and dep not in end:
                    break
                start = max(free[s], _ready(t, s, dep, end, t_msg))
                free[s] = start + cost[s][op.kind]
                busy[s] += cost[s][op.kind]
                times[s].append((op, start, free[s]))
                _ended(t, s, op, end, free[s])
                place[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _stuck(t, place)
    return Timeline(max(free), tuple(busy), tuple(tuple(x) for x in times))


def _shared(t: Table, cost: list, t_msg: float, speed, waiting: tuple) -> Timeline:
    """simulate's step where the running ops share a rate: from one event (an op's work or wire
    time ends, a message arrives) to the next, with k ops running (either), each does speed(k) of
    its compute seconds per second, then its stage's `waiting` share at one second a second."""
    end, place, now = {}, [0] * t.stages, 0.0
    running = [None] * t.stages  # [op, work left, start, wait left]
    busy = [0.0] * t.stages
    times = [[] for _ in range(t.stages)]
    remaining = sum(len(o) for o in t.ops)
    while remaining:
        arrivals = []
        for s in range(t.stages):
            if running[s] is not None or place[s] == len(t.ops[s]):
                continue
            op = t.ops[s][place[s]]
            dep = _dependency(t, s, op)
            if dep is not None and dep not in end:
                continue
            ready = _ready(t, s, dep, end, t_msg)
            if ready > now:
                arrivals.append(ready)
            else:
                c = cost[s][op.kind]
                running[s] = [op, c * (1 - waiting[s]), now, c * waiting[s]]
        computing = [s for s in range(t.stages) if running[s] is not None and running[s][1] > 0]
        waits = [s for s in range(t.stages) if running[s] is not None and running[s][1] <= 0]
        if not computing and not waits:
            if not arrivals:
                raise _stuck(t, place)
            now = min(arrivals)
            continue
        rate = speed(len(computing) + len(waits))
        step = min([running[s][1] / rate for s in computing] + [running[s][3] for s in waits] +
                   [a - now for a in arrivals])
        now += step
        for s in computing + waits:
            op, left, start, wait = running[s]
            scale = 1e-12 * max(1.0, cost[s][op.kind])
            if s in computing:
                left -= step * rate
                running[s][1] = left if left > scale else 0.0
                if left > scale or wait > scale:
                    continue
            else:
                wait -= step
                if wait > scale:
                    running[s][3] = wait
                    continue
            running[s] = None
            busy[s] += now - start
            times[s].append((op, start, now))
            _ended(t, s, op, end, now)
            place[s] += 1
            remaining -= 1
    return Timeline(now, tuple(busy), tuple(tuple(x) for x in times))


def peaks(t: Table) -> tuple:
    """Per stage, the most (chunk, micro-batch) activations held at once: from its forward until
    its backward has finished with them (BW, or W: a deferred W keeps what it multiplies)."""
    out = []
    for ops in t.ops:
        live = peak = 0
        for op in ops:
            live += 1 if op.kind is Kind.F else -1 if op.kind in (Kind.BW, Kind.W) else 0
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)
