"""A job's communicators are made at setup (Grid.connect), in one global order, and counted after
it; order-free ops share one communicator whatever a tuple's order; barrier blocks the host; a
checkpoint's folder is named by one rank."""
import time

import pytest
import torch

import gridweave as gw


def _connect(ctx, marker):
    grid = ctx.init(dp=2, sp=2, pp=2)
    # each rank names a different part of the job: the union is made on every rank, links by their members
    mine = [("dp", "sp")] if ctx.rank == 0 else [gw.LinePart(("sp", "dp"), gw.Span.WITHIN, 2)]
    if grid.coords["pp"] == 0:
        mine.append(gw.grid.Link(("pp",), 0, 1, 0))
    n = grid.connect(mine + ["pp", None])
    grid.seal()
    before = grid.communicators()
    # order-free ops on either order of the tuple: one communicator, made at setup
    t = torch.full((2,), float(ctx.rank), dtype=torch.float64, device="cpu")
    grid.all_reduce(t, axis=("sp", "dp"))
    grid.all_reduce(t, axis=("dp", "sp"))
    grid.barrier(axis=("sp", "dp"))
    grid.link("pp", 0, 1, 0)
    mid = grid.communicators()
    # an order-dependent op on the other order is another communicator: made late, and counted
    grid.all_gather(t, axis=("sp", "dp"))
    after = grid.communicators()
    # barrier blocks the host until every rank reached it: rank 0 writes the marker after a sleep
    if ctx.rank == 0:
        time.sleep(0.3)
        open(marker, "w").write("here")
    grid.barrier()
    seen = open(marker).read() if ctx.rank else "here"
    line = grid.ranks(("dp", "sp"))
    gw.shutdown()
    return n, before, mid, after, seen, t.tolist(), line


def test_connect_makes_the_union_of_every_ranks_lines_and_counts_the_late_ones(pool, tmp_path):
    res = pool.run(_connect, 8, str(tmp_path / "marker"), timeout=120)
    for n, before, mid, after, seen, t, line in res:
        # world, pp, (dp, sp), the part, the link (0 > 1 on channel 0): five items, on every rank
        assert n == 5, n
        assert before["after_setup"] == 0 and mid == before, (before, mid)
        assert after["after_setup"] == 1 and after["late"][0].startswith("comm/sp,dp/"), after
        assert seen == "here"
        # one all-reduce of the ranks over the line, then another of those sums: 4 x the line's sum
        assert len(line) == 4 and t == [float(sum(line) * 4)] * 2, (t, line)


def _save_twice(ctx, folder, fail):
    from gridweave import checkpoint

    grid = ctx.init(dp=2, timeout=30.0)
    p = torch.nn.Parameter(torch.arange(4, dtype=torch.float64, device="cpu") + ctx.rank)
    items = [(f"w{ctx.rank}", p, (4,))]
    first = checkpoint.save(folder, 3, items, grid, lambda q: {"param": q}, {})
    second = checkpoint.save(folder, 3, items, grid, lambda q: {"param": q}, {})
    out = [str(first), str(second)]
    if fail:  # rank 0 cannot make the next folder (a file is in its way): every rank fails at once
        blocked = f"{folder}/blocked"
        if ctx.rank == 0:
            open(blocked, "w").write("a file where the checkpoint folder should be")
        try:
            checkpoint.save(blocked, 4, items, grid, lambda q: {"param": q}, {})
            out.append("no error")
        except OSError as e:
            out.append(f"{type(e).__name__}: {e}")
    gw.shutdown()
    return out


def test_a_checkpoint_folder_is_named_by_one_rank_and_told_to_all(pool, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    res = pool.run(_save_twice, 2, str(folder), True, timeout=90)
    assert res[0][:2] == res[1][:2], res  # the same folders on both ranks
    assert res[0][0].endswith("step-00000003") and res[0][1].endswith("step-00000003.1"), res[0]
    assert res[0][2].startswith("WriteError") and "blocked/step-00000004" in res[0][2], res[0]
    assert res[1][2].startswith("WriteError") and "rank 0 could not make" in res[1][2], res[1]
    step_dir, index = gw.checkpoint.open_index(folder)
    assert step_dir.name == "step-00000003.1"


def _census(ctx):
    from gridweave.measure import HostReads

    grid = ctx.init(dp=2)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float32, device="cpu"))
    p.grad = torch.full_like(p, float("inf") if ctx.rank == 0 else 1.0)
    opt = gw.optim.OffloadAdam([p], grid=grid, max_grad_norm=1.0)
    with HostReads() as plain:
        taken = opt.step()  # the norm is not finite: skipped by the device's flag, unread
    before = p.detach().clone()
    with HostReads() as scaled:
        grid.any(True)  # a collective whose answer is read on the host
        torch.tensor([1.0], device="cpu")  # a tensor from Python data
        p.detach().sum().item()  # a read in the caller
        gw.nn.moe.swiglu_experts(torch.ones(3, 2, dtype=torch.float64, device="cpu"),  # the loop's sizes: a read
                                 torch.tensor([1, 2], device="cpu"), torch.ones(2, 4, 2, dtype=torch.float64,
                                 device="cpu"), torch.ones(2, 2, 2, dtype=torch.float64, device="cpu"))
        torch.nonzero(p.detach() > 0)  # a shape that depends on the values
        # a flag reduced over the grid, left on the device: no read
        still = grid.any(torch.tensor(True, device="cpu"))
    out = (plain.counts(), scaled.counts(), bool(taken), opt.step_count, torch.equal(before, torch.ones(4, device="cpu")),
           bool(still))
    gw.shutdown()
    return out


def test_the_host_read_census_files_each_read_where_it_happens(pool):
    """gw.measure.HostReads: an optimizer step whose norm is not finite decides on the device (no
    read, and it is skipped: the weights and the step count stay); a read inside a collective,
    one in the caller and a tensor made from Python data are each filed where they happened."""
    for plain, other, taken, steps, unchanged, still in pool.run(_census, 2, timeout=60):
        assert plain["reads"] == {"collective": 0, "optimizer": 0, "moe_dispatch": 0, "step": 0}, plain
        assert plain["tensors_from_python"] == 0 and plain["shape_syncs"] == 0, plain
        assert not taken and steps == 0 and unchanged
        assert other["reads"] == {"collective": 1, "optimizer": 0, "moe_dispatch": 1, "step": 1}, other
        # any()'s flag, the test's own three (the bool flag, the counts) and none from the tensor any()
        assert other["tensors_from_python"] == 4 and other["shape_syncs"] == 1 and still, other
        assert any(site.startswith("grid.py:any") for site in other["sites"]), other
