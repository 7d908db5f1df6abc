"""NCCL's rules on the CPU transport (gw.init(emulate="nccl"), cpp/emulate_nccl.h): code that
would deadlock on GPUs ends in a CommTimeout naming the op on every rank, and correct code
(grouped point-to-point, the ring, collectives) gives numpy's answer with the same counters."""
import os
import time

import numpy as np
import pytest
import torch

import gridweave as gw

RULES = "nccl"
HANG = 3.0   # the grid timeout where the code under test deadlocks: how long it takes to say so
PASS = 60.0  # where it must pass: generous, so a loaded machine cannot turn a pass into a timeout


def _ring_exchange(ctx, grouped, emulate, n_floats=5):
    """Each rank passes a block to the next rank of the sp ring: receive from the previous one
    and send to the next, as one group or (the old Ring::exchange) as two ungrouped calls."""
    hangs = not grouped and emulate == RULES
    grid = ctx.init(sp=ctx.world_size, emulate=emulate, timeout=HANG if hangs else PASS)
    r, n = grid.index("sp"), grid.size("sp")
    block = torch.arange(n_floats, dtype=torch.float64, device="cpu") + 100 * r
    got = torch.empty(n_floats, dtype=torch.float64, device="cpu")
    prev, nxt = (r - 1) % n, (r + 1) % n
    try:
        if grouped:
            works = grid.batch_isend_irecv([gw.P2POp("irecv", got, prev, "sp"), gw.P2POp("isend", block, nxt, "sp")])
            for w in works:
                w.wait()
        else:
            recv = grid.recv(got, prev, "sp", async_op=True)
            send = grid.send(block, nxt, "sp", async_op=True)
            recv.wait()
            send.wait()
    except gw.CommError as e:
        return type(e).__name__, str(e)
    return "ok", got.tolist()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ungrouped_ring_exchange_times_out_naming_the_op_on_every_rank(pool, n):
    res = pool.run(_ring_exchange, n, False, RULES)
    # every rank fails naming its op on the sp line; the first to time out aborts its
    # communicator (the watchdog's abort), which a neighbour may meet as a closed connection
    # before its own timeout
    for status, value in res:
        assert status in ("CommTimeout", "CommError") and "on axis 'sp'" in value, (status, value)
    assert any(status == "CommTimeout" and "recv on axis 'sp'" in value and "NCCL's rules" in value
               for status, value in res), res


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("emulate", [None, RULES])
def test_grouped_ring_exchange_gives_the_previous_ranks_block(pool, n, emulate):
    res = pool.run(_ring_exchange, n, True, emulate)
    for r, (status, value) in enumerate(res):
        assert status == "ok", value
        np.testing.assert_array_equal(value, np.arange(5) + 100 * ((r - 1) % n))


def test_the_ungrouped_exchange_passes_on_the_host_transport(pool):
    """Gloo and MPI progress every message independently: the hazard is NCCL's only."""
    res = pool.run(_ring_exchange, 3, False, None)
    for r, (status, value) in enumerate(res):
        assert status == "ok", value
        np.testing.assert_array_equal(value, np.arange(5) + 100 * ((r - 1) % 3))


def _send_send(ctx, eager):
    """Both ranks send first, then receive: a send-send cycle NCCL only survives while the
    messages fit its buffers (eager_bytes, NCCL_BUFFSIZE's part)."""
    os.environ["GRIDWEAVE_EMULATE_EAGER_BYTES"] = str(eager)
    try:
        grid = ctx.init(dp=2, emulate=RULES, timeout=PASS if eager else HANG)
    finally:
        del os.environ["GRIDWEAVE_EMULATE_EAGER_BYTES"]
    other = 1 - grid.rank
    mine = torch.full((16,), float(grid.rank), dtype=torch.float32, device="cpu")
    got = torch.empty(16, dtype=torch.float32, device="cpu")
    try:
        send = grid.send(mine, other, "dp", async_op=True)
        grid.recv(got, other, "dp")
        send.wait()
        grid.barrier("dp")  # a buffered send is done on its side only: neither rank closes under the other's
    except gw.CommError as e:
        return type(e).__name__, str(e)
    return "ok", got.tolist()


def test_a_send_waits_for_its_receive_unless_it_fits_the_buffers(pool):
    res = pool.run(_send_send, 2, 0)
    # the first rank to time out aborts its communicator (the watchdog's abort), so its peer may
    # fail on the closed connection before its own timeout: every rank fails, one times out
    assert all(status in ("CommTimeout", "CommError") for status, _ in res), res
    assert any(status == "CommTimeout" and ("send on axis 'dp'" in value or "recv on axis 'dp'" in value)
               for status, value in res), res
    for r, (status, value) in enumerate(pool.run(_send_send, 2, 64)):  # 64 bytes: buffered
        assert status == "ok", value
        assert value == [float(1 - r)] * 16


def _tags_out_of_order(ctx, emulate, pause=0.0):
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first. Tags keep them apart on
    Gloo and MPI; NCCL matches them in order and would swap the two messages silently.
    pause: rank 0 waits between its two sends (the first one has failed by then)."""
    grid = ctx.init(dp=2, emulate=emulate, timeout=HANG if emulate == RULES else PASS)
    try:
        if grid.rank == 0:
            a = grid.send(torch.ones(4, device="cpu"), 1, "dp", tag=1, async_op=True)
            time.sleep(pause)
            b = grid.send(torch.full((4,), 2.0, device="cpu"), 1, "dp", tag=2, async_op=True)
            a.wait()
            b.wait()
            return "ok", None
        two = torch.empty(4, device="cpu")
        one = torch.empty(4, device="cpu")
        w2 = grid.recv(two, 0, "dp", tag=2, async_op=True)
        w1 = grid.recv(one, 0, "dp", tag=1, async_op=True)
        w2.wait()
        w1.wait()
        return "ok", (one.tolist(), two.tolist())
    except gw.CommError as e:
        return type(e).__name__, str(e)


def test_tags_that_disagree_with_the_order_are_an_error_under_the_rules(pool):
    (s0, v0), (s1, v1) = pool.run(_tags_out_of_order, 2, None)
    assert s0 == s1 == "ok" and v1 == ([1.0] * 4, [2.0] * 4)
    (s0, v0), (s1, v1) = pool.run(_tags_out_of_order, 2, RULES)
    assert s0 == "CommError" and "issue order" in v0 and "tag 1" in v0 and "tag 2" in v0, v0
    assert s1 in ("CommError", "CommTimeout"), v1


def test_an_op_refused_after_a_failure_names_the_failure(pool):
    """The second send is submitted after the first has failed: its refusal repeats why (it
    raced the first's failure in CI, and said only "failed earlier")."""
    (s0, v0), _ = pool.run(_tags_out_of_order, 2, RULES, 2.0)
    assert s0 == "CommError" and "failed earlier" in v0 and "issue order" in v0 and "tag 1" in v0, v0


def _recv_any(ctx):
    grid = ctx.init(dp=3, emulate=RULES, timeout=PASS)
    if grid.rank != 0:
        return "skipped"
    try:
        grid.recv_any(torch.empty(2, device="cpu"), [1, 2], "dp")
    except gw.GridError as e:
        return str(e)
    return "no error"


def test_there_is_no_receive_from_any(pool):
    msg = pool.run(_recv_any, 3)[0]
    assert "cannot receive from any" in msg, msg


def _capabilities(ctx, emulate):
    grid = ctx.init(dp=2, emulate=emulate)
    caps = grid.capabilities("dp")
    grid.barrier()
    return caps


def test_capabilities_say_what_nccls_say(pool):
    caps = pool.run(_capabilities, 2, RULES)[0]
    assert caps["recv_any"] is False and caps["matches_tags"] is False and caps["matches_fingerprints"] is False
    assert caps["stream_ordered"] is False  # host memory: no stream to order against
    host = pool.run(_capabilities, 2, None)[0]
    assert host["matches_tags"] is True


def _collectives(ctx, emulate):
    grid = ctx.init(dp=2, sp=ctx.world_size // 2, emulate=emulate, timeout=PASS)
    r = grid.rank
    x = torch.arange(6, dtype=torch.float64, device="cpu") + r
    grid.all_reduce(x, "sp")
    g = grid.all_gather(torch.tensor([float(r), -float(r)], dtype=torch.float64, device="cpu"), ("dp", "sp"))
    rs = grid.reduce_scatter(torch.arange(8, dtype=torch.float32, device="cpu") * (r + 1), "dp")
    b = torch.full((3,), float(r), dtype=torch.float64, device="cpu")
    grid.broadcast(b, "sp", src=1)
    a2a = grid.all_to_all(torch.arange(4, dtype=torch.int64, device="cpu") + 10 * r, "sp")
    w = grid.all_reduce(torch.ones(5, device="cpu"), "dp", async_op=True)  # two in flight, in order
    grid.barrier("dp")
    total = w.wait()
    return (x.tolist(), g.tolist(), rs.tolist(), b.tolist(), a2a.tolist(), total.tolist(), grid.stats(),
            grid.coords)


@pytest.mark.parametrize("n", [4, 8])
def test_collectives_under_the_rules_match_the_host_transport_and_its_counters(pool, n):
    host = pool.run(_collectives, n, None)
    ruled = pool.run(_collectives, n, RULES)
    for h, e in zip(host, ruled):
        assert h == e  # the same values and the same per-axis counters
    # and the values are numpy's
    sp = n // 2
    for r, (x, g, rs, b, a2a, total, _, coords) in enumerate(ruled):
        line = [q for q in range(n) if q // sp == r // sp]
        np.testing.assert_array_equal(x, sum(np.arange(6) + q for q in line))
        assert total == [2.0] * 5
        assert b == [float(line[1])] * 3


def _opposite_orders(ctx, emulate):
    """Ranks 0 and 1 share two lines, the world and sp, and first touch them in opposite
    orders (async ops, which may run side by side): lines made lazily, each rank waits in the
    making of one line for a member busy making the other."""
    grid = ctx.init(dp=2, sp=2, emulate=emulate, timeout=PASS if emulate == RULES else HANG)
    first, second = (None, "sp") if grid.rank % 2 == 0 else ("sp", None)
    try:
        wa = grid.all_reduce(torch.ones(2, device="cpu"), first, async_op=True)
        wb = grid.all_reduce(torch.ones(2, device="cpu"), second, async_op=True)
        a, b = wa.wait(), wb.wait()
    except gw.CommError as e:
        return type(e).__name__
    return a.tolist(), b.tolist()


def test_lines_touched_in_opposite_orders_do_not_deadlock(pool):
    res = pool.run(_opposite_orders, 4, RULES)
    for r, (a, b) in enumerate(res):
        assert (a, b) == (([4.0, 4.0], [2.0, 2.0]) if r % 2 == 0 else ([2.0, 2.0], [4.0, 4.0])), (r, a, b)
    if pool.transport == "gloo":  # made lazily (no rules), the same order times out
        assert "CommTimeout" in pool.run(_opposite_orders, 4, None)


def _one_never_comes(ctx):
    if ctx.rank == 1:
        return "stayed away"
    try:
        ctx.init(dp=2, emulate=RULES, timeout=HANG)
    except gw.CommError as e:
        return type(e).__name__
    return "no error"


def test_a_member_that_never_comes_is_a_timeout_at_init(pool):
    if not pool.capabilities()["survives_peer_failure"]:
        pytest.skip("MPI's connections are made by mpirun, not at a line's first use")
    assert pool.run(_one_never_comes, 2) == ["CommTimeout", "stayed away"]


def test_emulation_refuses_the_nccl_backend_and_unknown_rules():
    with pytest.raises(gw.GridError, match="emulate"):
        gw.init(dp=1, emulate="ucx")
    with pytest.raises(gw.GridError, match="emulate='nccl' runs NCCL's rules on a CPU transport|nccl"):
        gw.init(dp=1, backend="nccl", emulate="nccl")
