"""Every op and dtype against a numpy reference, on 1, 2, 4 and 8 ranks (the reductions also\nwith large buffers, on 2, 3, 4 and 8)."""
import numpy as np
import pytest
import torch

from refs import DTYPES, as_np, rank_input, reduce_np

SIZES = [1, 2, 4, 8]


def _all_ops(ctx, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    grid = ctx.init(dp=ctx.world_size)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, (2 * n, 3), dtype, salt=1) for q in range(n)]
    mine = inputs[r].clone()
    checks = {}

    out = grid.all_gather(mine, axis="dp")
    checks["all_gather"] = np.array_equal(as_np(out), np.concatenate([as_np(x) for x in inputs]))
    out = grid.all_gather(mine, axis="dp", dim=1)
    checks["all_gather_dim1"] = np.array_equal(as_np(out), np.concatenate([as_np(x) for x in inputs], axis=1))
    for op in ("sum", "max", "min"):
        ref = reduce_np([as_np(x) for x in inputs], op)
        rs = grid.reduce_scatter(mine, axis="dp", op=op)
        checks[f"reduce_scatter_{op}"] = np.array_equal(as_np(rs), ref[2 * r:2 * r + 2])
        t = mine.clone()
        grid.all_reduce(t, axis="dp", op=op)
        checks[f"all_reduce_{op}"] = np.array_equal(as_np(t), ref)
    rs1 = grid.reduce_scatter(torch.cat([mine] * n, dim=1), axis="dp", dim=1)
    checks["reduce_scatter_dim1"] = np.array_equal(as_np(rs1), reduce_np([as_np(x) for x in inputs], "sum"))

    src = n - 1
    t = mine.clone()
    grid.broadcast(t, axis="dp", src=src)
    checks["broadcast"] = np.array_equal(as_np(t), as_np(inputs[src]))
    t = mine.clone()
    grid.reduce(t, axis="dp", dst=0, op="sum")
    ref = reduce_np([as_np(x) for x in inputs], "sum") if r == 0 else as_np(inputs[r])
    checks["reduce"] = np.array_equal(as_np(t), ref)

    full = rank_input(99, (n, 4), dtype, salt=2)
    part = torch.empty(1, 4, dtype=dtype, device="cpu")
    grid.scatter(part, full if r == src else None, axis="dp", src=src)
    checks["scatter"] = np.array_equal(as_np(part), as_np(full)[r:r + 1])
    g = grid.gather(mine, axis="dp", dst=0)
    checks["gather"] = (g is None) if r != 0 else np.array_equal(as_np(g), np.concatenate([as_np(x) for x in inputs]))

    a2a = grid.all_to_all(mine, axis="dp")
    ref = np.concatenate([as_np(inputs[q])[2 * r:2 * r + 2] for q in range(n)])
    checks["all_to_all"] = np.array_equal(as_np(a2a), ref)

    if n > 1:
        right, left = (r + 1) % n, (r - 1) % n
        buf = torch.empty_like(mine)
        # even ranks send first, odd ranks receive first: a ring of single sends and receives
        # that progresses under NCCL's rules too (an async send and then a receive on every
        # rank is the deadlock they forbid; grouped: grid.batch_isend_irecv)
        if r % 2 == 0:
            grid.send(mine, right, tag=5)
            grid.recv(buf, left, tag=5)
        else:
            grid.recv(buf, left, tag=5)
            grid.send(mine, right, tag=5)
        checks["send_recv"] = np.array_equal(as_np(buf), as_np(inputs[left]))
    grid.barrier()
    return checks


def _all_pass(pool, fn, n, dtype, count):
    """Run fn on n ranks; every rank's `count` named checks hold."""
    results = pool.run(fn, n, str(dtype).replace("torch.", ""))
    for r, checks in enumerate(results):
        bad = [k for k, ok in checks.items() if not ok]
        assert not bad, f"rank {r}: {bad}"
        assert len(checks) == count


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_op_matches_numpy(pool, n, dtype):
    _all_pass(pool, _all_ops, n, dtype, 15 if n > 1 else 14)


# Buffers from 64 KiB (the MPI transport's kRingBytes, in every dtype) run the reductions on
# the MPI transport's rings; an all-reduce whose count does not split into the members stays on
# MPI's own. Two ops in flight at once, waited for in the other order, keep their messages apart.
LARGE = 1 << 15  # elements of a member's chunk: 64 KiB and more in every dtype


def _large_reductions(ctx, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    grid = ctx.init(dp=ctx.world_size)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, (n * LARGE,), dtype, salt=3) for q in range(n)]
    checks = {}
    for op in ("sum", "max", "min"):
        ref = reduce_np([as_np(x) for x in inputs], op)
        rs = grid.reduce_scatter(inputs[r].clone(), axis="dp", op=op)
        checks[f"reduce_scatter_{op}"] = np.array_equal(as_np(rs), ref[r * LARGE:(r + 1) * LARGE])
        t = inputs[r].clone()
        grid.all_reduce(t, axis="dp", op=op)
        checks[f"all_reduce_{op}"] = np.array_equal(as_np(t), ref)
    uneven = [x[:n * LARGE - 1].clone() for x in inputs]  # does not split into n chunks (n > 1)
    t = uneven[r].clone()
    grid.all_reduce(t, axis="dp")
    checks["all_reduce_uneven"] = np.array_equal(as_np(t), reduce_np([as_np(x) for x in uneven], "sum"))
    a, b = inputs[r].clone(), (2 * inputs[r]).clone()
    wa = grid.all_reduce(a, axis="dp", async_op=True)
    wb = grid.reduce_scatter(b, axis="dp", async_op=True)
    rb, _ = wb.wait(), wa.wait()
    ref = reduce_np([as_np(x) for x in inputs], "sum")
    checks["two_in_flight"] = np.array_equal(as_np(a), ref) and np.array_equal(as_np(rb), 2 * ref[r * LARGE:(r + 1) * LARGE])
    return checks


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_large_reductions_match_numpy(pool, n, dtype):
    _all_pass(pool, _large_reductions, n, dtype, 8)


def _recv_any(ctx):
    grid = ctx.init(dp=ctx.world_size)
    n, r = ctx.world_size, ctx.rank
    if r == 0:
        got = {}
        pending = list(range(1, n))
        while pending:
            buf = torch.empty(3, dtype=torch.float64, device="cpu")
            s = grid.recv_any(buf, pending, tag=7)
            got[s] = buf.tolist()
            pending.remove(s)
        return got
    grid.send(torch.full((3,), float(r), dtype=torch.float64, device="cpu"), 0, tag=7)
    return None


def test_recv_any_takes_every_sender_once(pool):
    got = pool.run(_recv_any, 8)[0]
    assert got == {s: [float(s)] * 3 for s in range(1, 8)}


def _numpy_arrays(ctx):
    grid = ctx.init(dp=ctx.world_size)
    a = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * ctx.rank
    out = grid.all_gather(a, axis="dp")
    return out.tolist()


def test_numpy_arrays_are_accepted(pool):
    res = pool.run(_numpy_arrays, 2)
    ref = np.concatenate([np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * q for q in range(2)])
    assert res[0] == ref.tolist() and res[1] == ref.tolist()


# A synchronous op on contiguous CPU tensors runs in one native call (Communicator.*_host:
# issue and wait, no BufferView or Work); an async op takes the BufferView path. Both give
# numpy's result and the same traffic counters, and the engine's own checks (the count) hold
# on the one-call path too.
def _one_call_vs_async(ctx, dtype_name: str):
    from gridweave import GridError
    from gridweave._buffers import host_args

    dtype = getattr(torch, dtype_name)
    grid = ctx.init(dp=ctx.world_size)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, (n * 4, 3), dtype, salt=4) for q in range(n)]
    mine = inputs[r]
    ref_sum = reduce_np([as_np(x) for x in inputs], "sum")
    ref_gather = np.concatenate([as_np(x) for x in inputs])
    checks = {"eligible": host_args(mine, torch.empty_like(mine)) is not None,
              "strided_not_eligible": host_args(mine.t()) is None,
              "mixed_not_eligible": host_args(mine, mine.double() if dtype != torch.float64 else mine.float()) is None}
    counters = []
    for async_op in (False, True):
        grid.reset_stats()
        got = {}
        out = torch.empty(n * n * 4, 3, dtype=dtype, device="cpu")
        w = grid.all_gather(mine, "dp", out=out, async_op=async_op)
        got["all_gather"] = as_np(w.wait() if async_op else w)
        part = torch.empty(4, 3, dtype=dtype, device="cpu")
        w = grid.reduce_scatter(mine, "dp", out=part, async_op=async_op)
        got["reduce_scatter"] = as_np(w.wait() if async_op else w)
        t = mine.clone()
        w = grid.all_reduce(t, "dp", async_op=async_op)
        got["all_reduce"] = as_np(w.wait() if async_op else w)
        t = mine.clone()
        w = grid.broadcast(t, "dp", src=n - 1, async_op=async_op)
        got["broadcast"] = as_np(w.wait() if async_op else w)
        tag = "async" if async_op else "one_call"
        checks[f"{tag}_all_gather"] = np.array_equal(got["all_gather"], ref_gather)
        checks[f"{tag}_reduce_scatter"] = np.array_equal(got["reduce_scatter"], ref_sum[4 * r:4 * r + 4])
        checks[f"{tag}_all_reduce"] = np.array_equal(got["all_reduce"], ref_sum)
        checks[f"{tag}_broadcast"] = np.array_equal(got["broadcast"], as_np(inputs[n - 1]))
        counters.append(grid.stats())
    checks["same_counters"] = counters[0] == counters[1] and counters[0]["dp"]["ops"] == 4
    # A wrong `out` is refused before any message, with the op named: the right count in the
    # wrong shape (the Python check), the right trailing shape with the wrong count (the engine's).
    def refused(fn, words):
        try:
            fn()
        except GridError as e:
            return all(w in str(e) for w in words)
        return False

    flat = torch.empty(n * mine.numel(), dtype=dtype, device="cpu")
    checks["all_gather_out_shape"] = refused(lambda: grid.all_gather(mine, "dp", out=flat), ["all_gather", "shape"])
    short = torch.empty(3, 3, dtype=dtype, device="cpu")
    checks["reduce_scatter_out_count"] = refused(lambda: grid.reduce_scatter(mine, "dp", out=short),
                                                 ["reduce_scatter", "elements"])
    c = grid.comm("dp")
    out = torch.empty(n * mine.numel() + 1, dtype=dtype, device="cpu")
    # every member passes the same wrong count to the native call: the engine refuses it
    checks["count_checked"] = refused(lambda: c.all_gather_host(*host_args(mine, out), grid.timeout),
                                      ["all_gather", "elements"])
    return checks


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_one_call_host_path_matches_the_async_path(pool, n, dtype):
    _all_pass(pool, _one_call_vs_async, n, dtype, 15)
