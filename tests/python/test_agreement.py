"""Ranks that disagree inside one operation (op, element count, dtype, root, order of calls,
a send and its receive) end on every rank of the line with a CommError naming the operation,
the axis and what each rank passed: never an abort, never a result.

Detail (GRIDWEAVE_DEBUG=DETAIL) all-gathers every call's fingerprint first: the error is at
once, on every transport. Cheap (always on) relies on the transport matching messages by the
fingerprint (Gloo's tags): the ranks never exchange data, time out, then compare notes over
the store; transports without tags (MPI, NCCL) need Detail."""
import time

import pytest
import torch

import gridweave as gw

TIMEOUT = 3.0  # the Cheap level finds a disagreement at the timeout


def _calls(case, rank):
    """What rank `rank` calls in each case: a list of (grid method, args builder)."""
    f32, f64 = torch.float32, torch.float64

    def t(n, dtype=f32):
        return torch.full((n,), float(rank + 1), dtype=dtype, device="cpu")

    return {
        "all_gather count": [lambda g: g.all_gather(t(4 if rank == 0 else 8), axis="dp")],
        "all_gather dtype": [lambda g: g.all_gather(t(4, f32 if rank == 0 else f64), axis="dp")],
        "reduce_scatter count": [lambda g: g.reduce_scatter(t(4 if rank == 0 else 8), axis="dp")],
        "broadcast count": [lambda g: g.broadcast(t(4 if rank == 0 else 8), axis="dp", src=0)],
        "broadcast root": [lambda g: g.broadcast(t(4), axis="dp", src=rank)],
        "all_reduce count": [lambda g: g.all_reduce(t(3 if rank == 0 else 5), axis="dp")],
        "order": [lambda g: g.all_reduce(t(4), axis="dp"), lambda g: g.all_gather(t(4), axis="dp")][::1 if rank == 0 else -1],
    }[case]


CASES = ["all_gather count", "all_gather dtype", "reduce_scatter count", "broadcast count", "broadcast root",
         "all_reduce count", "order"]


def _disagree(ctx, case, level):
    grid = ctx.init(dp=2, timeout=TIMEOUT, check=level)
    grid.barrier(axis="dp")  # the line is connected: the disagreement hits the op itself (#2)
    start = time.monotonic()
    try:
        results = [call(grid) for call in _calls(case, ctx.rank)]
        return "no error", [r.tolist() for r in results], 0.0
    except gw.CommError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    finally:
        gw.shutdown()


def _levels(pool):
    levels = [gw.CheckLevel.Detail]
    if pool.capabilities()["matches_fingerprints"]:
        levels.append(gw.CheckLevel.Cheap)
    return levels


@pytest.mark.parametrize("case", CASES)
def test_ranks_that_disagree_get_a_comm_error_naming_what_each_passed(pool, case):
    for level in _levels(pool):
        res = pool.run(_disagree, 2, case, level, timeout=60)
        for kind, msg, elapsed in res:
            assert kind == "CommError", (level, kind, msg)  # not a timeout, not a result
            assert "ranks disagree on" in msg and "axis 'dp'" in msg, msg
            assert "rank 0 passed" in msg and "rank 1 passed" in msg, msg
            # no hang: bounded by the timeout plus the notes' exchange (5 s here)
            assert elapsed < 40, (level, elapsed)
        first = res[0][1]
        if case == "all_gather count":
            assert "all_gather #2 of 4 x float32" in first and "all_gather #2 of 8 x float32" in first, first
        if case == "all_gather dtype":
            assert "4 x float32" in first and "4 x float64" in first, first
        if case == "broadcast root":
            assert "root 0" in first and "root 1" in first, first
        if case == "order":
            assert "all_reduce #2" in first and "all_gather #2" in first, first


def _p2p_sizes(ctx, level, counts):
    grid = ctx.init(dp=2, timeout=TIMEOUT, check=level)
    grid.barrier(axis="dp")
    comm = grid.comm("dp")
    buf = torch.zeros(counts[ctx.rank], device="cpu")
    v = gw._buffers.view(buf)
    try:
        work = comm.send(v, 1, 7) if ctx.rank == 0 else comm.recv(v, 0, 7)
        work.wait(30.0)
        return "no error", buf.tolist()
    except gw.CommError as e:
        return type(e).__name__, str(e)
    finally:
        gw.shutdown()


@pytest.mark.parametrize("counts", [(4, 8), (8, 4)])
def test_a_send_and_a_receive_of_different_sizes_are_a_comm_error(pool, counts):
    """Cheap: Gloo matches a receive by tag, dtype and count, so the receive never takes a
    message of another size (Gloo would abort its loop thread): both sides end in a CommError
    naming both. MPI at Cheap: the receiving side's CommError names both counts (a short
    message is checked with MPI_Get_count, a long one is MPI's truncation error, returned,
    not fatal); the sender's eager message left. Detail, every transport: the receiver
    answers with what it passed, so the sender fails too."""
    levels = [gw.CheckLevel.Cheap, gw.CheckLevel.Detail]
    for level in levels:
        res = pool.run(_p2p_sizes, 2, level, counts, timeout=90)
        both = level == gw.CheckLevel.Detail or pool.capabilities()["matches_fingerprints"]
        for kind, msg in (res if both else res[1:]):
            assert kind == "CommError" and ("ranks disagree on" in msg or "recv" in msg), (level, kind, msg)
        if both:
            assert "ranks disagree on" in res[0][1], (level, res)
            assert f"{counts[0]} x float32" in res[0][1] and f"{counts[1]} x float32" in res[0][1], (level, res)
        elif counts[0] < counts[1]:
            assert f"sent {counts[0]} elements, this receive passed {counts[1]}" in res[1][1], res


def _p2p_agreeing(ctx):
    """At Detail a matched send and receive still deliver (the answer rides along)."""
    grid = ctx.init(dp=2, timeout=30.0, check=gw.CheckLevel.Detail)
    comm = grid.comm("dp")
    buf = torch.full((5,), float(ctx.rank + 1), device="cpu")
    v = gw._buffers.view(buf)
    for tag in (3, 4):
        (comm.send(v, 1, tag) if ctx.rank == 0 else comm.recv(v, 0, tag)).wait(30.0)
    return buf.tolist()


def test_matching_point_to_point_at_the_detail_level_delivers(pool):
    assert pool.run(_p2p_agreeing, 2) == [[1.0] * 5, [1.0] * 5]


def _skip_one(ctx, level):
    """Rank 1 skips the first all_reduce and joins the second."""
    grid = ctx.init(dp=2, timeout=TIMEOUT, check=level)
    grid.barrier(axis="dp")
    out = []
    try:
        for k in range(2 if ctx.rank == 0 else 1):
            out.append(grid.all_reduce(torch.full((4,), float(10 * k + ctx.rank), device="cpu"), axis="dp").tolist())
        grid.barrier(axis="dp")  # what a script's end looks like: one last agreement
        return "no error", out
    except gw.CommError as e:
        return type(e).__name__, str(e)
    finally:
        gw.shutdown()


def test_a_rank_that_skips_a_collective_and_joins_the_next_fails_everywhere(pool):
    """The first all_reduce pairs the two ranks' different calls (nothing tells them apart);
    what follows cannot agree: rank 0's second all_reduce meets rank 1's barrier."""
    for level in _levels(pool):
        res = pool.run(_skip_one, 2, level, timeout=60)
        for kind, msg in res:
            assert kind == "CommError", (level, kind, msg)
            assert "all_reduce #3" in msg and "barrier #3" in msg, msg


def _agreeing(ctx, level):
    grid = ctx.init(dp=2, tp=gw.Row(2), timeout=30.0, check=level)
    x = torch.arange(6, dtype=torch.float64, device="cpu") + ctx.rank
    return (grid.all_reduce(x.clone(), axis="tp").tolist(), grid.all_gather(x[:2], axis="dp").tolist(),
            grid.ranks("tp"), grid.ranks("dp"), grid.comm("tp").issued)


def test_the_detail_level_changes_no_result(pool):
    """Detail fingerprints every call; agreeing ranks get the same results as at Cheap, the
    results of the ops themselves, and the issued-op counts agree."""
    cheap = pool.run(_agreeing, 4, gw.CheckLevel.Cheap)
    detail = pool.run(_agreeing, 4, gw.CheckLevel.Detail)
    assert cheap == detail
    base = list(range(6))
    for tp_sum, dp_gather, tp_ranks, dp_ranks, issued in cheap:
        assert tp_sum == [sum(v + r for r in tp_ranks) for v in base]
        assert dp_gather == [float(v + r) for r in dp_ranks for v in base[:2]]
        assert issued == 1


def test_debug_environment_variable(monkeypatch):
    monkeypatch.setenv("GRIDWEAVE_DEBUG", "DETAIL")
    assert gw.grid.check_level() == gw.CheckLevel.Detail
    monkeypatch.setenv("GRIDWEAVE_DEBUG", "off")
    assert gw.grid.check_level() == gw.CheckLevel.Cheap
    monkeypatch.setenv("GRIDWEAVE_DEBUG", "loud")
    with pytest.raises(gw.GridError, match="GRIDWEAVE_DEBUG must be"):
        gw.grid.check_level()
