"""Segmented collectives on every axis and axis tuple of a 2x2x2 grid; traffic counters
against the algorithms' byte counts; async overlap."""
import itertools

import numpy as np
import pytest
import torch

from refs import as_np, rank_input, reduce_np

AXES = ["x", "y", "z", ("x", "y"), ("x", "z"), ("y", "z"), ("z", "y", "x")]


def _segmented(ctx, placement):
    grid = ctx.init(tp=__import__("gridweave").Cube(2), placement=placement, ranks_per_node=2)
    out = {}
    for axis in AXES:
        line = grid.ranks(axis)
        g, i = len(line), grid.index(axis)
        inputs = {q: rank_input(q, (g * 2, 5), torch.float64, salt=3) for q in line}
        mine = inputs[grid.rank]
        ag = grid.all_gather(mine, axis=axis)
        rs = grid.reduce_scatter(mine, axis=axis)
        ar = grid.all_reduce(mine.clone(), axis=axis)
        total = reduce_np([as_np(inputs[q]) for q in line], "sum")
        out[str(axis)] = (
            np.array_equal(as_np(ag), np.concatenate([as_np(inputs[q]) for q in line])),
            np.array_equal(as_np(rs), total[2 * i:2 * i + 2]),
            np.array_equal(as_np(ar), total),
            sorted(line),
        )
    return grid.rank, grid.coords, out


@pytest.mark.parametrize("placement", ["naive", "topology"])
def test_segmented_ops_on_every_axis_and_pair(pool, placement):
    results = pool.run(_segmented, 8, placement)
    coords = {r: c for r, c, _ in results}
    for r, c, out in results:
        for axis, (ag, rs, ar, line) in out.items():
            assert ag and rs and ar, f"rank {r} axis {axis}"
            # The line holds exactly the ranks that agree with r off the axis.
            names = [axis] if axis in "xyz" else list(eval(axis))
            expect = sorted(q for q, cq in coords.items()
                            if all(cq[a] == c[a] for a in "xyz" if a not in names))
            assert line == expect
    assert sorted(tuple(c[a] for a in "zyx") for c in coords.values()) == list(itertools.product(range(2), repeat=3))


def _counters(ctx):
    import gridweave as gw

    grid = ctx.init(dp=2, tp=gw.Square(2), ranks_per_node=4)  # 4 ranks per emulated node
    n = 3 * 4 * 8  # float64 elements
    t = torch.ones(n, dtype=torch.float64, device="cpu")
    grid.reset_stats()
    grid.all_gather(t, axis="c")
    grid.reduce_scatter(t, axis=("dp", "r"))
    grid.all_reduce(t, axis="dp")
    grid.broadcast(t, axis="r", src=1)
    s = grid.stats()
    ring_right = {}
    for axis in ["c", ("dp", "r"), "dp"]:
        line = grid.ranks(axis)
        ring_right[axis if isinstance(axis, str) else ",".join(axis)] = line[(grid.index(axis) + 1) % len(line)]
    return grid.rank, s, ring_right, grid.index("r")


def test_counters_equal_algorithm_bytes(pool):
    nb = 3 * 4 * 8 * 8
    rpn = 4
    total_bcast = {"msgs": 0, "bytes": 0}
    for rank, s, right, r_index in pool.run(_counters, 8):
        def sent(axis):
            c = s[axis]
            return c["sent_intra"]["bytes"] + c["sent_inter"]["bytes"], c

        # Ring all-gather on c (2 ranks): (g-1) * nbytes sent to the right neighbour.
        b, c = sent("c")
        assert b == (2 - 1) * nb and c["ops"] == 1
        intra = right["c"] // rpn == rank // rpn
        assert c["sent_intra" if intra else "sent_inter"]["bytes"] == nb
        # Ring reduce-scatter on (dp, r) (4 ranks): (g-1)/g * nbytes, all to one neighbour.
        b, c = sent("dp,r")
        assert b == 3 * nb // 4 and c["sent_intra"]["messages"] + c["sent_inter"]["messages"] == 3
        intra = right["dp,r"] // rpn == rank // rpn
        assert c["sent_intra" if intra else "sent_inter"]["bytes"] == 3 * nb // 4
        # Ring all-reduce on dp (2 ranks): 2 (g-1)/g * nbytes.
        b, _ = sent("dp")
        assert b == 2 * 1 * nb // 2
        assert s["dp"]["recv_intra"]["bytes"] + s["dp"]["recv_inter"]["bytes"] == nb
        # Binomial broadcast on r: the root sends once (g - 1 = 1), the other receives once.
        b, c = sent("r")
        total_bcast["msgs"] += c["sent_intra"]["messages"] + c["sent_inter"]["messages"]
        total_bcast["bytes"] += b
        recv = c["recv_intra"]["messages"] + c["recv_inter"]["messages"]
        assert recv == (0 if r_index == 1 else 1)
    assert total_bcast == {"msgs": 4 * 1, "bytes": 4 * nb}  # 4 r-lines, g - 1 messages each


def _traffic(ctx):
    import gridweave as gw

    grid = ctx.init(tp=gw.SubGraph(4), dp=2, placement="topology", ranks_per_node=4)
    return grid.traffic("sg", "all_gather", 1024), grid.placement.physical_order


def test_traffic_model_from_a_live_grid(pool):
    # n=8, g=4, n_node=4, topology: SUPER eq. (6)-(7): all n*g messages stay inside a node.
    model, order = pool.run(_traffic, 8)[0]
    assert order[-1] == "sg"
    assert model["messages"] == 32 and model["intra_messages"] == 32 and model["inter_messages"] == 0
    assert model["bytes"] == 32 * 1024


def _overlap(ctx):
    grid = ctx.init(dp=ctx.world_size)
    t = torch.full((1 << 20,), float(ctx.rank + 1), device="cpu")
    work = grid.all_reduce(t, axis="dp", async_op=True)
    a = torch.randn(128, 128, device="cpu")
    steps = 0
    # Compute until the op completes on its own: proof that it progresses in the
    # background, without the caller waiting on it.
    while not work.test() and steps < 200000:
        a = torch.tanh(a @ a * 1e-3)
        steps += 1
    done_before_wait = work.test()
    out = work.wait()
    return done_before_wait, steps, float(out[12345]), float(out[-1])


def test_async_op_overlaps_compute(pool):
    for done, steps, v1, v2 in pool.run(_overlap, 4):
        assert done, "async all_reduce did not progress while the caller computed"
        assert v1 == v2 == 10.0
