"""`gridweave flight DIR`: reads the flight recorder's dumps (rank<R>.json, one a rank: the last
operations each rank's engine issued, cpp/flight.h) and names the rank that made the others wait.

The rules, in order (the first that finds a rank names it):
1. never joined: a member of a line others waited on that wrote no dump, never made the line's
   communicator, or issued nothing on it;
2. mismatch: the members' ops at one sequence number of one line differ (kind, bytes, dtype,
   root): the minority is named (as many on each side: no culprit, both sides said);
3. behind: a member issued fewer collectives on a line than the sequence number the others wait
   at and waits on nothing itself;
4. out of step: every rank behind waits elsewhere (one skipped a collective and went on): each
   waited line's issued counts are a vote, and the rank at odds with the most majorities is named
   (or the idle point-to-point peer it waits on); else who waits on whom is followed to its end;
5. a point-to-point op's peer that waits on nothing.
Every dump a clean shutdown's: no culprit. Otherwise no culprit, and why. Standard library only:
it runs anywhere the dumps are copied to."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import GridError

FORMAT = "gridweave-flight/1"
_NAME = re.compile(r"rank(\d+)\.json")
_UNFINISHED = ("issued", "started", "failed")
_P2P = ("send", "recv")
_SHOWN = 6  # unfinished ops listed a rank; the rest are counted


@dataclass(frozen=True)
class Wait:
    """One op a rank had not completed when it dumped: it waited on it (or it failed)."""
    rank: int
    line: str
    members: tuple
    seq: int
    kind: str
    bytes: int
    dtype: str
    peer: int      # p2p: the peer's global rank; -1 otherwise
    state: str     # issued | started | failed
    waited_s: float  # from its issue to its failure, or to the dump

    def describe(self) -> str:
        what = f"line '{self.line}' {list(self.members)} "
        what += f"#{self.seq} {self.kind}" if self.kind not in _P2P else \
            f"{self.kind} {'to' if self.kind == 'send' else 'from'} rank {self.peer} (p2p #{self.seq})"
        if self.kind != "connect":
            what += f" {self.bytes} B {self.dtype}".rstrip()
        end = "failed after" if self.state == "failed" else f"{self.state}, waited"
        return f"{what}, {end} {self.waited_s:.1f} s"


@dataclass
class Report:
    """culprit: the rank named (None: no culprit); why: the rest of the first line; waits: every
    rank's unfinished ops; ranks: the ranks whose dumps were read; missing: ranks of the world
    without one; reasons: each rank's dump reason."""
    culprit: int | None
    why: str
    waits: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    reasons: dict = field(default_factory=dict)
    coords: dict = field(default_factory=dict)
    folder: str = ""
    stale: list = field(default_factory=list)  # ranks whose dump is of an earlier run (left out)

    def headline(self) -> str:
        return f"culprit: rank {self.culprit} {self.why}" if self.culprit is not None else f"no culprit: {self.why}"

    def lines(self) -> list:
        """The printed report: the headline first, then who waited on what."""
        out = [self.headline()]
        world = len(self.ranks) + len(self.missing)
        out.append(f"read {len(self.ranks)} dumps of a world of {world} from {self.folder}" +
                   (f"; no dump from rank(s) {_ranks(self.missing)}" if self.missing else "") +
                   (f"; left out the dump(s) of rank(s) {_ranks(self.stale)}: an earlier run's" if self.stale else ""))
        by_reason = {}
        for r, why in sorted(self.reasons.items()):
            by_reason.setdefault(why, []).append(r)
        for why, rs in by_reason.items():
            out.append(f"  rank(s) {_ranks(rs)}: {_short(why)}")
        out.append("waits (each rank's unfinished ops, oldest first):")
        for r in self.ranks:
            mine = [w for w in self.waits if w.rank == r]
            coords = ", ".join(f"{a}={c}" for a, c in self.coords.get(r, {}).items())
            who = f"  rank {r}" + (f" ({coords})" if coords else "")
            if not mine:
                out.append(f"{who}: nothing unfinished")
                continue
            out.append(f"{who}:")
            out += [f"    {w.describe()}" for w in mine[:_SHOWN]]
            if len(mine) > _SHOWN:
                out.append(f"    ... and {len(mine) - _SHOWN} more")
        return out


def _ranks(rs) -> str:
    return ", ".join(str(r) for r in sorted(rs))


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load(folder) -> dict:
    """{rank: its dump} of every rank<R>.json in `folder`; GridError on a missing or empty folder
    or a file that is not a dump."""
    path = Path(folder)
    if not path.is_dir():
        raise GridError(f"{folder}: no such folder (the flight recorder writes rank<R>.json files to the run's "
                        "flight/ folder, GRIDWEAVE_FLIGHT_DIR or gw.init(flight_dir=...))")
    dumps = {}
    for f in sorted(path.iterdir()):
        m = _NAME.fullmatch(f.name)
        if not m:
            continue
        try:
            d = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GridError(f"cannot read {f}: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("entries"), list) or \
                not isinstance(d.get("lines"), list) or d.get("rank") != int(m.group(1)):
            raise GridError(f"{f} is not a flight recorder dump of rank {m.group(1)} (format {FORMAT})")
        bad = _malformed(d)
        if bad:
            raise GridError(f"{f} is not a flight recorder dump of rank {m.group(1)}: {bad}")
        dumps[d["rank"]] = d
    if not dumps:
        raise GridError(f"{folder} holds no flight recorder dump (rank<R>.json)")
    return dumps


# The fields the analysis reads, and their types (a dump is data from another machine: checked).
_DUMP_FIELDS = {"world_size": int, "dumped_s": (int, float), "steady_to_wall_s": (int, float), "reasons": list,
                "run": (str, type(None))}
_LINE_FIELDS = {"name": str, "members": list, "collectives": int}
_ENTRY_FIELDS = {"kind": str, "line": str, "members": list, "seq": int, "peer": int, "root": int, "bytes": int,
                 "dtype": str, "state": str, "issued_s": (int, float), "ended_s": (int, float, type(None)),
                 "tag": int}


def _malformed(d: dict) -> str:
    """What is wrong with a dump's fields ("" when nothing)."""
    for where, items, fields in (("", [d], _DUMP_FIELDS), ("line", d["lines"], _LINE_FIELDS),
                                 ("entry", d["entries"], _ENTRY_FIELDS)):
        for i, item in enumerate(items):
            what = f"its {where} {i}" if where else "it"
            if not isinstance(item, dict):
                return f"{what} is not an object"
            for name, kind in fields.items():
                if not isinstance(item.get(name), kind) or isinstance(item.get(name), bool):
                    return f"{what} has no valid '{name}'"
    return ""


def _key(line, members) -> tuple:
    return line, tuple(members)


def _label(key) -> str:
    return f"line '{key[0]}' {list(key[1])}"


def _waits(dumps) -> list:
    out = []
    for r, d in sorted(dumps.items()):
        for e in d["entries"]:
            if e["state"] not in _UNFINISHED:
                continue
            end = e["ended_s"] if e["state"] == "failed" and e["ended_s"] is not None else d["dumped_s"]
            out.append(Wait(r, e["line"], tuple(e["members"]), e["seq"], e["kind"], e["bytes"], e["dtype"],
                            e["peer"], e["state"], max(0.0, end - e["issued_s"])))
    return out


def _sig(e) -> tuple:
    return e["kind"], e["bytes"], e["dtype"], e["root"]


def _sig_str(s) -> str:
    kind, nbytes, dtype, root = s
    return f"{kind} of {nbytes} bytes {dtype}".rstrip() + (f", root {root}" if root >= 0 else "")


def _newest_run(dumps: dict) -> tuple:
    """(the dumps of the run that dumped last, the ranks of earlier runs' dumps): a folder a later
    run (or a restart) wrote into may hold a rank's file from before, which says nothing of this one."""
    runs = {}
    for r, d in dumps.items():
        runs.setdefault(d.get("run", ""), []).append(r)
    if len(runs) < 2:
        return dumps, []
    newest = max(runs, key=lambda run: max(dumps[r]["dumped_s"] + dumps[r]["steady_to_wall_s"] for r in runs[run]))
    return {r: dumps[r] for r in runs[newest]}, sorted(r for run, rs in runs.items() if run != newest for r in rs)


def analyse(folder) -> Report:
    """Reads every rank<R>.json in `folder` and names the culprit (see the module's rules)."""
    dumps, stale = _newest_run(load(folder))
    world = max(max(d["world_size"] for d in dumps.values()), max(dumps) + 1)
    report = Report(None, "", _waits(dumps), sorted(dumps), [r for r in range(world) if r not in dumps],
                    {r: d.get("reason", "") for r, d in dumps.items()},
                    {r: {a: c for a, c in d.get("coords", {}).items() if d.get("axes", {}).get(a, 2) > 1}
                     for r, d in dumps.items()}, str(folder), stale)  # coordinates on the axes of size 1 say nothing
    # each rank's lines: how many collectives it issued on each (the ring forgets, these do not)
    issued = {r: {} for r in dumps}
    for r, d in dumps.items():
        for l in d["lines"]:
            k = _key(l["name"], l["members"])
            issued[r][k] = max(issued[r].get(k, 0), l["collectives"])
    waiting = {}  # line key -> [Wait] of its collectives and connects
    for w in report.waits:
        if w.kind not in _P2P:
            waiting.setdefault(_key(w.line, w.members), []).append(w)
    if not report.missing and all(set(d["reasons"]) <= {"shutdown"} for d in dumps.values()):
        # every rank dumped at its own clean end: an op still open there is one no wait had yet seen finish
        report.why = "every rank shut down cleanly" + (
            f" ({len(report.waits)} op(s) not yet seen to complete at their shutdown)" if report.waits else
            "; every recorded op completed on every rank")
        return report
    for rule in (_never_joined, _mismatch, _behind):
        found = rule(dumps, report, issued, waiting)
        if found:  # (rank, why), or (None, why): the rule saw what happened but no one rank to name
            report.culprit, report.why = found
            return report
    report.why = _nobody(dumps, report)
    return report


def _never_joined(dumps, report, issued, waiting):
    found = {}  # rank -> (waiters, why)
    for key, ws in waiting.items():
        first = min(ws, key=lambda w: (w.seq, w.rank))
        on = f"{first.kind} #{first.seq}" if first.kind != "connect" else "its making"
        waiters = sorted({w.rank for w in ws})
        for m in key[1]:
            if m in {w.rank for w in ws}:
                continue
            if m not in dumps:
                why = f"never joined: it wrote no flight record (it died, was killed, or never started) while " \
                      f"rank(s) {_ranks(waiters)} waited on {_label(key)} ({on})"
            elif key not in issued[m]:
                why = f"never joined {_label(key)}: it never made its communicator while rank(s) " \
                      f"{_ranks(waiters)} waited on it ({on})"
            elif first.kind != "connect" and issued[m][key] == 0:
                why = f"never joined {_label(key)}: it issued nothing there while rank(s) {_ranks(waiters)} " \
                      f"waited at {on}"
            else:
                continue
            found.setdefault(m, (set(), why))[0].update(waiters)
    for w in report.waits:  # a point-to-point op whose peer wrote nothing
        if w.kind in _P2P and w.peer >= 0 and w.peer not in dumps:
            why = f"never joined: it wrote no flight record (it died, was killed, or never started) while rank " \
                  f"{w.rank} waited on a {w.kind} {'to' if w.kind == 'send' else 'from'} it on {_label((w.line, w.members))}"
            found.setdefault(w.peer, (set(), why))[0].add(w.rank)
    if not found:
        return None
    r = min(found, key=lambda m: (-len(found[m][0]), m))
    others = sorted(set(found) - {r})
    return r, found[r][1] + (f" (also never joined: rank(s) {_ranks(others)})" if others else "")


def _mismatch(dumps, report, issued, waiting):
    ops = {}  # (line key, seq) -> {rank: entry}
    for r, d in dumps.items():
        for e in d["entries"]:
            if e["kind"] in _P2P or e["kind"] == "connect":
                continue
            ops.setdefault((_key(e["line"], e["members"]), e["seq"]), {})[r] = e
    found = []
    for (key, seq), by_rank in ops.items():
        groups = {}
        for r, e in by_rank.items():
            groups.setdefault(_sig(e), []).append(r)
        if len(groups) < 2:
            continue
        order = sorted(groups.items(), key=lambda g: (len(g[1]), min(g[1])))
        sig, minority = order[0]
        when = min(dumps[r]["steady_to_wall_s"] + e["issued_s"] for r, e in by_rank.items())
        rest = "; ".join(f"rank(s) {_ranks(rs)} passed {_sig_str(s)}" for s, rs in order[1:])
        tie = len(order[1][1]) == len(minority)  # nothing says which side is wrong
        why = f"passed {_sig_str(sig)} at {_label(key)} #{seq}, where {rest}"
        if len(minority) > 1:
            why += f" (with rank(s) {_ranks(minority[1:])})"
        found.append((when, None if tie else sorted(minority)[0],
                      f"rank(s) {_ranks(minority)} passed {_sig_str(sig)} at {_label(key)} #{seq}, where {rest} "
                      "(as many on each side: which is wrong is not known)" if tie else why))
    if not found:
        return None
    _, r, why = min(found, key=lambda f: f[0])  # the earliest disagreement: later ones follow from it
    return r, why


def _behind(dumps, report, issued, waiting):
    busy = {w.rank for w in report.waits}
    behind = {}  # rank -> (gap, key, its count, seq waited at, waiters)
    for key, ws in waiting.items():
        ws = [w for w in ws if w.kind != "connect"]
        if not ws:
            continue
        seq = min(w.seq for w in ws)
        waiters = sorted({w.rank for w in ws if w.seq == seq})
        for m in key[1]:
            n = issued.get(m, {}).get(key)
            if m in waiters or n is None or n >= seq:
                continue
            cand = (seq - n, key, n, seq, waiters)
            if m not in behind or cand[0] > behind[m][0]:
                behind[m] = cand
    if behind:
        idle = [m for m in behind if m not in busy]
        if idle:  # it waits on nothing: the others wait on it
            r = min(idle, key=lambda m: (-len(behind[m][4]), m))
            _, key, n, seq, waiters = behind[r]
            kind = next(w.kind for w in waiting[key] if w.seq == seq)
            return r, f"is behind on {_label(key)}: it issued {n} collective(s) there while rank(s) " \
                      f"{_ranks(waiters)} waited at #{seq} ({kind}), and it waits on nothing"
        odd = _out_of_step(dumps, report, issued, waiting, busy)
        if odd:
            return odd
        # every rank behind waits elsewhere: follow who waits on whom to the end of the chain
        r = min(behind, key=lambda m: (behind[m][2], m))
        seen = [r]
        while True:
            nxt = [m for m, c in behind.items() if m not in seen and
                   any(w.rank == seen[-1] and _key(w.line, w.members) == c[1] for w in report.waits)]
            if not nxt:
                break
            seen.append(min(nxt))
        r = seen[-1]
        _, key, n, seq, waiters = behind[r]
        cycle = len(seen) > 1 and any(w.rank == r and _key(w.line, w.members) == behind[seen[0]][1]
                                      for w in report.waits)
        mine = [w for w in report.waits if w.rank == r]
        return r, f"is behind on {_label(key)}: it issued {n} collective(s) there while rank(s) " \
                  f"{_ranks(waiters)} waited at #{seq}; it waits itself on {mine[0].describe()}" + \
                  (f" (ranks {' -> '.join(map(str, seen))} wait on each other in a cycle: lines used in "
                   "different orders)" if cycle else "")
    for w in report.waits:  # a point-to-point op whose peer waits on nothing
        if w.kind in _P2P and w.peer >= 0 and w.peer in dumps and w.peer not in busy:
            return w.peer, f"is behind: rank {w.rank} waited on a {w.kind} " \
                           f"{'to' if w.kind == 'send' else 'from'} it on {_label((w.line, w.members))} " \
                           f"(tag {_tag(dumps, w)}), and it waits on nothing (it never issued the matching op)"
    return None


def _out_of_step(dumps, report, issued, waiting, busy):
    """A rank that skipped a collective and went on to wait elsewhere: on each line others wait
    on, the members' issued counts are a vote, and the one rank out of step with the most lines'
    majorities is named (or the idle peer it waits on by point-to-point, which it waits behind)."""
    odd = {}  # rank -> [(line key, its count, the majority's count, the majority)]
    for key, ws in waiting.items():
        counts = {m: issued[m].get(key, 0) for m in key[1] if m in dumps}
        votes = {}
        for m, c in counts.items():
            votes.setdefault(c, []).append(m)
        ranked = sorted(votes.items(), key=lambda v: -len(v[1]))
        if len(ranked) < 2 or len(ranked[0][1]) == len(ranked[1][1]):
            continue  # all agree, or no majority to be out of step with
        majority_count, majority = ranked[0]
        for c, ms in ranked[1:]:
            for m in ms:
                odd.setdefault(m, []).append((key, c, majority_count, majority))
    if not odd:
        return None
    most = max(len(v) for v in odd.values())
    top = [m for m, v in odd.items() if len(v) == most]
    if len(top) > 1:
        return None
    r = top[0]
    for w in report.waits:  # out of step because it waits on a point-to-point peer that waits on nothing
        if w.rank == r and w.kind in _P2P and w.peer >= 0 and w.peer in dumps and w.peer not in busy:
            return w.peer, f"is behind: rank {r} waited on a {w.kind} {'to' if w.kind == 'send' else 'from'} it " \
                           f"on {_label((w.line, w.members))} (tag {_tag(dumps, w)}), and it waits on nothing"
    key, c, majority_count, majority = odd[r][0]
    mine = [w for w in report.waits if w.rank == r]
    elsewhere = f"; it waits itself on {mine[0].describe()}" if mine else ", and it waits on nothing"
    return r, f"is out of step on {_label(key)}: it issued {c} collective(s) there where rank(s) " \
              f"{_ranks(majority)} issued {majority_count}" + \
              (f" (and on {len(odd[r]) - 1} more line(s))" if len(odd[r]) > 1 else "") + elsewhere


def _tag(dumps, w) -> int:
    for e in dumps[w.rank]["entries"]:
        if e["kind"] == w.kind and e["seq"] == w.seq and e["line"] == w.line and tuple(e["members"]) == w.members:
            return e["tag"]
    return -1


def _nobody(dumps, report) -> str:
    failed = sorted(r for r, d in dumps.items() if any(x != "shutdown" for x in d.get("reasons", [])))
    if not report.waits:
        if report.missing and failed:
            return f"no rank waited on an unfinished op, but rank(s) {_ranks(report.missing)} wrote no dump " \
                   f"(died or were killed before they could) and rank(s) {_ranks(failed)} failed"
        return "every recorded op completed on every rank" + \
            (f" (rank(s) {_ranks(failed)} dumped on a failure outside these ops)" if failed else "")
    lines = sorted({(w.line, w.members) for w in report.waits})
    return f"rank(s) {_ranks({w.rank for w in report.waits})} waited on {len(lines)} line(s) " \
           f"({', '.join(_label(k) for k in lines[:3])}{', ...' if len(lines) > 3 else ''}), but every member " \
           "had issued the same op there: a slow or failed link or process, not a rank behind or at odds"
