"""Bad input and faults: a clear error on every rank within the timeout, nothing hangs."""
import os
import time

import pytest
import torch

import gridweave as gw


def _init_error(ctx, kwargs):
    try:
        ctx.init(**kwargs)
    except gw.GridError as e:
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dp=3), "needs 3 ranks but the world has 8"),
    (dict(dp=2, tp=gw.Cube(2)), "needs 16 ranks but the world has 8"),
    (dict(tp=gw.Row(3), dp=2), "needs 6 ranks"),
    (dict(dp=8, backend="tcp"), "unknown backend 'tcp'"),
    (dict(dp=8, backend="nccl"), "nccl"),
    (dict(dp=8, placement="random"), "placement must be"),
    (dict(dp=8, timeout=-1), "timeout must be"),
    (dict(dp=8, ranks_per_node=0), "ranks_per_node"),
])
def test_bad_configuration_fails_on_every_rank(pool, kwargs, needle):
    res = pool.run(_init_error, 8, kwargs)
    for name, msg in res:
        assert name == "GridError" and needle in msg, (name, msg)


def test_backend_mpi_outside_a_launcher_is_a_clear_error(monkeypatch):
    for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(gw.GridError, match="backend 'mpi'"):  # or: built without MPI
        gw.init(dp=1, backend="mpi")


def test_bad_tp_shape_is_a_value_error():
    with pytest.raises(ValueError, match="Cube size must be a positive integer"):
        gw.Cube(0)
    with pytest.raises(gw.GridError, match="tp must be"):
        gw.init(tp=4)


def _nccl_without_gpu(ctx):
    try:
        ctx.init(dp=1, backend="nccl")
    except gw.GridError as e:
        return str(e)


def test_nccl_without_a_gpu_is_a_clear_error(pool):
    msg = pool.run(_nccl_without_gpu, 1)[0]
    assert "no CUDA GPU" in msg or "without the NCCL transport" in msg


def _bad_shapes(ctx):
    grid = ctx.init(dp=2, tp=gw.Row(4))
    errors = []
    for call in (
        lambda: grid.reduce_scatter(torch.ones(6, 2, device="cpu"), axis="tp"),       # 6 rows do not split over 4
        lambda: grid.all_to_all(torch.ones(3, device="cpu"), axis=("dp", "tp")),
        lambda: grid.all_reduce(torch.ones(4, 4, device="cpu").t(), axis="tp"),       # in place needs contiguous
        lambda: grid.all_gather(torch.ones(2, device="cpu"), axis="q"),
        lambda: grid.all_reduce(torch.ones(2, dtype=torch.complex64, device="cpu"), axis="tp"),
        lambda: grid.broadcast(torch.ones(2, device="cpu"), axis="tp", src=9),
        lambda: grid.all_reduce(torch.ones(2, device="cpu"), axis="tp", op="avg"),
    ):
        try:
            call()
            errors.append(None)
        except gw.GridError as e:
            errors.append(str(e))
    # Nothing was half-sent: the grid still works, in step on every rank.
    ok = grid.all_reduce(torch.ones(3, device="cpu"), axis="tp").tolist() == [4.0] * 3
    return errors, ok


def test_bad_shapes_raise_before_any_communication(pool):
    for errors, ok in pool.run(_bad_shapes, 8):
        assert ok
        needles = ["does not split into 4", "does not split into 8", "must be contiguous", "unknown axis 'q'",
                   "complex64", "root/peer 9", "unknown reduce op 'avg'"]
        assert len(errors) == len(needles)
        for e, needle in zip(errors, needles):
            assert e is not None and needle in e, (e, needle)


def _skip(ctx, connected):
    grid = ctx.init(dp=4, timeout=2.0)
    grid.barrier()
    t = torch.ones(8, device="cpu")
    if connected:  # the axis communicator exists; the skip hits the collective itself
        grid.all_reduce(t, axis="dp")
    if ctx.rank == 3:
        time.sleep(4.0)  # skips the collective and outlives the others' timeout
        return "skipped"
    start = time.monotonic()
    try:
        grid.all_reduce(t, axis="dp")
    except gw.CommTimeout as e:
        return "CommTimeout", str(e), time.monotonic() - start
    except gw.CommError as e:
        return "CommError", str(e), time.monotonic() - start
    return "no error"


@pytest.mark.parametrize("connected", [False, True])
def test_a_rank_that_skips_a_collective_times_out_everywhere(pool, connected):
    res = pool.run(_skip, 4, connected, timeout=60)
    assert res[3] == "skipped"
    for kind, msg, elapsed in res[:3]:
        # The ring neighbours of rank 3 time out; the others see their pair closed by them.
        assert kind in ("CommTimeout", "CommError"), msg
        assert "all_reduce on axis 'dp'" in msg and "peers [0, 1, 2, 3]" in msg, msg
        assert elapsed < 30
    assert any(kind == "CommTimeout" for kind, _, _ in res[:3])


def _die(ctx):
    grid = ctx.init(dp=4, timeout=20.0)
    grid.barrier()
    if ctx.rank == 2:
        os._exit(17)  # the process dies mid-job
    start = time.monotonic()
    try:
        for _ in range(3):
            grid.all_reduce(torch.ones(1024, device="cpu"), axis="dp")
    except gw.CommError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", 0.0


def test_a_rank_that_dies_gives_a_comm_error_on_survivors(pool):
    res = pool.run(_die, 4, timeout=60, raw=True)
    assert res[2][0] == "died"
    if not pool.capabilities()["survives_peer_failure"]:
        # MPI: mpirun ends the whole job when a rank dies; nobody is left waiting
        assert all(status == "died" and "process exited" in msg for status, msg in res), res
        return
    for status, (kind, msg, elapsed) in [res[0], res[1], res[3]]:
        assert status == "ok"
        assert kind in ("CommError", "CommTimeout"), msg
        assert "all_reduce on axis 'dp'" in msg
        assert elapsed < 25


def _after_failure(ctx):
    grid = ctx.init(dp=2)
    return grid.all_reduce(torch.ones(2, device="cpu"), axis="dp").tolist()


def test_pool_recovers_after_a_death(pool):
    assert pool.run(_after_failure, 2) == [[2.0, 2.0]] * 2


class _FakeDeviceArray:
    """Looks like a cupy array on a GPU (no GPU needed to build one)."""

    def __init__(self, n):
        self._buf = torch.zeros(n, device="cpu")
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (self._buf.data_ptr(), False),
                                         "version": 3, "strides": None, "stream": 0}


def _device_mismatch(ctx):
    grid = ctx.init(dp=2)
    # both ranks connect the line first: the rank whose check fires first must not tear the
    # grid down while its peer is still connecting (the race CI saw under load)
    grid.barrier("dp")
    try:
        grid.all_reduce(_FakeDeviceArray(4), axis="dp")
    except gw.GridError as e:
        return str(e)


def test_gpu_array_on_the_gloo_backend_is_a_clear_error(pool):
    for msg in pool.run(_device_mismatch, 2):
        assert msg and "is on cuda but the" in msg and "transport needs cpu memory" in msg


def _shutdown_cancels(ctx):
    grid = ctx.init(dp=2, timeout=60.0)
    grid.barrier()
    if ctx.rank == 1:
        return None
    work = grid.recv_any(torch.empty(3, device="cpu"), [1], async_op=True)  # rank 1 never sends
    start = time.monotonic()
    gw.shutdown()
    try:
        work.wait()
    except gw.CommError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_shutdown_cancels_pending_receives(pool):
    msg, elapsed = pool.run(_shutdown_cancels, 2)[0]
    assert "cancelled: the grid was shut down" in msg and elapsed < 10
