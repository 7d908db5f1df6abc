"""The flight recorder: each rank's last ops, dumped on a failure, a SIGTERM and shutdown, and
`gridweave flight` naming the rank that made the others wait. Each case is planted on 4 ranks with
a short timeout: a rank that skips a collective (behind), one that passes another size or dtype
at the same sequence number (mismatch), one that never joins a line or dies before it (never
joined), and a clean run (no culprit)."""
import json
import os

import pytest
import torch

import gridweave as gw
from gridweave import cli

TIMEOUT = 3.0  # the ranks that wait on a planted fault give up after this (a clean run has the default)


def _level(pool):
    # Cheap finds a disagreement where the transport matches messages by fingerprint (Gloo's
    # tags: the ranks time out); elsewhere (MPI, NCCL's rules) Detail finds it at once
    return gw.CheckLevel.Cheap if pool.capabilities()["matches_fingerprints"] else gw.CheckLevel.Detail


def _planted(ctx, folder, case, level):
    grid = ctx.init(dp=ctx.world_size, timeout=30.0 if case == "clean" else TIMEOUT, flight_dir=folder, check=level)
    t = torch.ones(8, device="cpu")
    try:
        if case != "never joins":  # the line is made and used once by every rank
            grid.all_reduce(t, axis="dp")
            grid.broadcast(t, axis="dp", src=1)
        if case == "clean":
            if ctx.rank < 2:  # a point-to-point pair too
                peer = 1 - ctx.rank
                if ctx.rank == 0:
                    grid.send(t, peer, axis="dp", tag=7)
                else:
                    grid.recv(t, peer, axis="dp", tag=7)
            grid.all_gather(t, axis="dp")
            return "ok"
        if ctx.rank == 3:
            if case == "dies":
                os._exit(17)  # no dump: a killed rank writes nothing
            if case in ("skips", "never joins"):
                return "skipped"
        if case == "mismatch" and ctx.rank == 3:
            t = torch.ones(16, device="cpu", dtype=torch.float64)  # the same sequence number, another size
        try:
            grid.all_reduce(t, axis="dp")
        except gw.CommError as e:
            return type(e).__name__
        return "no error"
    finally:
        gw.shutdown()  # the shutdown dump, before the test reads the folder


@pytest.mark.parametrize("case, rule", [
    ("skips", "is behind on line 'dp' [0, 1, 2, 3]: it issued 2 collective(s) there"),
    ("mismatch", "passed all_reduce of 128 bytes float64 at line 'dp' [0, 1, 2, 3] #3"),
    ("never joins", "never joined line 'dp' [0, 1, 2, 3]"),
    ("dies", "never joined: it wrote no flight record"),
])
def test_flight_names_the_rank_that_made_the_others_wait(pool, tmp_path, capsys, case, rule):
    if case == "dies" and not pool.capabilities()["survives_peer_failure"]:
        pytest.skip("MPI: mpirun ends the whole job when a rank dies; nobody is left waiting")
    res = pool.run(_planted, 4, str(tmp_path), case, _level(pool), timeout=60, raw=True)
    waiting = 4 if case == "mismatch" else 3  # the ranks that wait on the op (rank 3 too when it passed another)
    for status, value in res[:waiting]:
        assert status == "ok" and value in ("CommError", "CommTimeout"), res
    report = gw.flight.analyse(tmp_path)
    assert report.culprit == 3 and rule in report.why, report.lines()
    assert cli.main(["flight", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == report.headline() and out[0].startswith("culprit: rank 3 ")
    assert {w.rank for w in report.waits} == set(range(waiting)), report.lines()
    if case == "never joins" and "issued nothing" not in report.why:  # Gloo makes a line at its first op
        assert "never made its communicator" in report.why
    # a waiting rank's dump keeps its failure as the reason: the shutdown after it is added, not put first
    d = json.loads((tmp_path / "rank0.json").read_text())
    assert d["reason"].startswith(("CommError", "CommTimeout")) and d["reasons"][-1] == "shutdown", d["reasons"]
    assert d["coords"]["dp"] == 0 and d["world_size"] == 4
    if case == "dies":
        assert not (tmp_path / "rank3.json").exists()
    elif case != "mismatch":
        assert json.loads((tmp_path / "rank3.json").read_text())["reason"] == "shutdown"


def test_a_clean_run_has_no_culprit(pool, tmp_path, capsys):
    assert pool.run(_planted, 4, str(tmp_path), "clean", _level(pool)) == ["ok"] * 4
    report = gw.flight.analyse(tmp_path)
    assert report.culprit is None and report.waits == [] and report.missing == [], report.lines()
    assert report.reasons == {r: "shutdown" for r in range(4)}
    assert cli.main(["flight", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == \
        "no culprit: every rank shut down cleanly; every recorded op completed on every rank"
    entries = json.loads((tmp_path / "rank1.json").read_text())["entries"]
    ops = [(e["kind"], e["line"], e["seq"]) for e in entries if e["line"] == "dp"]
    assert ops == [("connect", "dp", 0), ("all_reduce", "dp", 1), ("broadcast", "dp", 2), ("recv", "dp", 1),
                   ("all_gather", "dp", 3)], ops
    recv = next(e for e in entries if e["kind"] == "recv")
    assert (recv["peer"], recv["tag"], recv["bytes"], recv["dtype"], recv["state"]) == (0, 7, 32, "float32", "completed")
    for e in entries:  # every op stamped in order
        assert e["state"] == "completed" and e["issued_s"] <= e["started_s"] <= e["ended_s"], e


def _records(ctx, folder):
    grid = ctx.init(dp=1, flight_dir=folder)
    t = torch.ones(3, device="cpu")
    grid.all_reduce(t, axis="dp")
    grid.all_reduce(t, axis="dp", async_op=True).wait()
    records = grid.flight_records()
    grid.shutdown()
    return records, json.loads(open(os.path.join(folder, "rank0.json")).read())["reasons"]


def test_the_recorder_holds_each_op_in_order(pool, tmp_path):
    """What grid.flight_records() reads back: each op's kind, sequence number, size, dtype and
    state (the SIGTERM dump: test_flight_signal.py)."""
    records, reasons = pool.run(_records, 1, str(tmp_path))[0]
    assert [(r["kind"], r["seq"], r["state"]) for r in records if r["line"] == "dp"] == [
        ("connect", 0, "completed"), ("all_reduce", 1, "completed"), ("all_reduce", 2, "completed")]
    first = next(r for r in records if r["kind"] == "all_reduce")
    assert first["count"] == 3 and first["bytes"] == 12 and first["peer"] == -1 and first["dtype"] == "float32"
    assert reasons == ["shutdown"]


def test_flight_answers_an_unreadable_folder_with_one_line(tmp_path, capsys):
    assert cli.main(["flight", str(tmp_path / "nowhere")]) == 1
    assert cli.main(["flight", str(tmp_path)]) == 1  # empty
    (tmp_path / "rank0.json").write_text("{not json")
    assert cli.main(["flight", str(tmp_path)]) == 1
    (tmp_path / "rank0.json").write_text(json.dumps({"format": "something else"}))
    assert cli.main(["flight", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(e.startswith("gridweave flight: ") for e in err), err
    assert "no such folder" in err[0] and "holds no flight recorder dump" in err[1] and "cannot read" in err[2]
    assert "is not a flight recorder dump" in err[3]
    with pytest.raises(gw.GridError):
        gw.flight.analyse(tmp_path)


def _dump(rank, lines, entries, world=2):
    return {"format": "gridweave-flight/1", "rank": rank, "world_size": world, "coords": {"dp": rank},
            "reason": "CommTimeout: x", "reasons": ["CommTimeout: x"], "dumped_s": 20.0, "steady_to_wall_s": 0.0,
            "lines": [{"name": n, "members": m, "collectives": c, "p2p": p} for n, m, c, p in lines],
            "entries": [{"id": i + 1, "kind": k, "line": n, "members": m, "seq": s, "tag": -1, "peer": peer, "root": -1,
                         "count": 1, "bytes": 4, "dtype": "float32", "state": st, "issued_s": 10.0,
                         "started_s": 10.0, "ended_s": None} for i, (k, n, m, s, peer, st) in enumerate(entries)]}


def test_rank_waiting_elsewhere_is_followed_to_the_one_waiting_on_nothing(tmp_path):
    """Rank 0 waits on line a at #2, which rank 1 never issued: rank 1 waits on line b at #1,
    which rank 2 never issued; rank 2 waits on nothing. Rank 2 is named, not rank 1."""
    a, b = [0, 1], [1, 2]
    dumps = [_dump(0, [("a", a, 2, 0)], [("all_reduce", "a", a, 2, -1, "started")], 3),
             _dump(1, [("a", a, 1, 0), ("b", b, 1, 0)], [("all_reduce", "b", b, 1, -1, "started")], 3),
             _dump(2, [("b", b, 0, 0)], [], 3)]
    for d in dumps:
        (tmp_path / f"rank{d['rank']}.json").write_text(json.dumps(d))
    report = gw.flight.analyse(tmp_path)
    assert report.culprit == 2 and "never joined line 'b' [1, 2]: it issued nothing there" in report.why, report.why
    # one op later on line b: rank 1 waits at #2, rank 2 issued #1 only
    dumps[1]["lines"][1]["collectives"] = 2
    dumps[1]["entries"][0]["seq"] = 2
    dumps[2]["lines"][0]["collectives"] = 1
    (tmp_path / "rank1.json").write_text(json.dumps(dumps[1]))
    (tmp_path / "rank2.json").write_text(json.dumps(dumps[2]))
    report = gw.flight.analyse(tmp_path)
    assert report.culprit == 2 and report.why.startswith("is behind on line 'b' [1, 2]: it issued 1"), report.why


def _write(folder, dumps):
    for d in dumps:
        (folder / f"rank{d['rank']}.json").write_text(json.dumps(d))


def test_a_rank_that_skipped_a_collective_and_waits_elsewhere_is_the_odd_one_out(tmp_path):
    """Rank 3 skipped line l's #3 and went on to m, where it waits at #6; ranks 0-2 wait at l #3
    and never reached m #6: every rank is behind somewhere and busy. The vote over each line's
    members names rank 3, out of step with the three others on both."""
    ring = [0, 1, 2, 3]
    dumps = [_dump(r, [("l", ring, 3, 0), ("m", ring, 5, 0)], [("all_reduce", "l", ring, 3, -1, "started")], 4)
             for r in range(3)]
    dumps.append(_dump(3, [("l", ring, 2, 0), ("m", ring, 6, 0)], [("all_gather", "m", ring, 6, -1, "started")], 4))
    _write(tmp_path, dumps)
    report = gw.flight.analyse(tmp_path)
    assert report.culprit == 3 and report.why.startswith("is out of step on line"), report.why
    assert "(and on 1 more line(s))" in report.why and "rank(s) 0, 1, 2 issued" in report.why, report.why


def test_two_ranks_that_disagree_name_no_culprit(tmp_path):
    """A line of two whose members passed different sizes at one sequence number: nothing says
    which is wrong, so neither is named (the rule says why)."""
    a = [0, 1]
    dumps = [_dump(r, [("a", a, 2, 0)], [("all_reduce", "a", a, 2, -1, "started")]) for r in range(2)]
    dumps[1]["entries"][0]["bytes"] = 8
    _write(tmp_path, dumps)
    report = gw.flight.analyse(tmp_path)
    assert report.culprit is None and "which is wrong is not known" in report.why, report.why
    assert report.headline().startswith("no culprit: rank(s) 0 passed all_reduce of 4 bytes"), report.headline()


def test_a_clean_shutdown_with_ops_not_yet_seen_complete_names_no_one(tmp_path):
    """On a stream-ordered transport a send is stamped ended only once a wait sees its event: a
    clean end may leave one open. Every rank's reason shutdown: no culprit."""
    p = [0, 1]
    dumps = [_dump(0, [("pp", p, 0, 1)], [("send", "pp", p, 1, 1, "started")]), _dump(1, [("pp", p, 0, 1)], [])]
    for d in dumps:
        d["reason"], d["reasons"] = "shutdown", ["shutdown"]
    _write(tmp_path, dumps)
    report = gw.flight.analyse(tmp_path)
    assert report.culprit is None and report.why.startswith("every rank shut down cleanly (1 op(s)"), report.why


def test_a_point_to_point_peer_that_waits_on_nothing_is_named(tmp_path):
    p = [0, 1]
    dumps = [_dump(0, [("pp", p, 0, 1)], [("recv", "pp", p, 1, 1, "started")]), _dump(1, [("pp", p, 0, 0)], [])]
    _write(tmp_path, dumps)
    report = gw.flight.analyse(tmp_path)
    assert report.culprit == 1 and "waited on a recv from it" in report.why and "waits on nothing" in report.why


def test_a_dump_with_a_bad_field_is_one_clear_error(tmp_path, capsys):
    d = _dump(0, [("a", [0, 1], 1, 0)], [("all_reduce", "a", [0, 1], 1, -1, "started")])
    del d["entries"][0]["issued_s"]
    _write(tmp_path, [d])
    with pytest.raises(gw.GridError, match="its entry 0 has no valid 'issued_s'"):
        gw.flight.analyse(tmp_path)
    assert cli.main(["flight", str(tmp_path)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_earlier_runs_dump_in_the_folder_is_left_out(tmp_path, capsys):
    """A run writes into a folder an earlier run dumped in: rank 1 was killed this time (no dump
    of this run), and its file is the earlier run's clean shutdown. The report reads this run's
    dumps only, so rank 1 is the one that never joined."""
    a = [0, 1]
    old = _dump(1, [("a", a, 3, 0)], [])
    old["run"], old["reason"], old["reasons"], old["dumped_s"] = "job-1#0", "shutdown", ["shutdown"], 5.0
    new = _dump(0, [("a", a, 1, 0)], [("all_reduce", "a", a, 2, -1, "started")])
    new["run"] = "job-2#0"
    _write(tmp_path, [old, new])
    report = gw.flight.analyse(tmp_path)
    assert report.stale == [1] and report.missing == [1] and report.ranks == [0], report.lines()
    assert report.culprit == 1 and report.why.startswith("never joined: it wrote no flight record"), report.why
    assert cli.main(["flight", str(tmp_path)]) == 0
    assert "left out the dump(s) of rank(s) 1: an earlier run's" in capsys.readouterr().out
