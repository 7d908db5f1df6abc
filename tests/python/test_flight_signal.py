"""The flight recorder's SIGTERM dump (a launcher ending the job): the engine's own signal handler
and thread write it, so a rank blocked in a wait of the engine (its Python runs no signal handler
until the wait ends) dumps too; then the handler set before runs, or the rank ends by the signal
as it would have."""
import json
import os
import signal
import threading
import time

import pytest
import torch

WAIT = 30.0  # how long a rank watches for the other's dump


def _dump(folder, rank, reason="SIGTERM", wait=WAIT):
    """rank<R>.json once its reason is `reason` (written whole: through a rename), else None."""
    path = os.path.join(folder, f"rank{rank}.json")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                d = json.load(f)
            if d["reason"] == reason:
                return d
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    return None


def _recv_entry(d):
    return next((e["kind"], e["state"], e["ended_s"]) for e in reversed(d["entries"]) if e["kind"] == "recv")


def _blocked(ctx, folder, handler):
    """Rank 1 blocks in a receive that rank 0 sends only once it has seen rank 1's SIGTERM dump."""
    prev = signal.getsignal(signal.SIGTERM)
    seen = []
    if handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # the job's own
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        grid = ctx.init(dp=2, timeout=60.0, flight_dir=folder)
        t = torch.ones(4, device="cpu")
        grid.all_reduce(t, axis="dp")  # the line is made: only the receive is left to wait on
        if ctx.rank == 1:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # while the recv waits
            grid.recv(t, 0, axis="dp", tag=3)
            grid.shutdown()  # its dump before the test reads the folder
            return seen  # the previous handler ran once the wait was over
        d = _dump(folder, 1)
        if handler and d is not None:
            grid.send(t, 1, axis="dp", tag=3)
        return None if d is None else _recv_entry(d)
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_sigterm_dumps_a_rank_blocked_in_a_wait_then_runs_the_previous_handler(pool, tmp_path):
    seen_by_0, seen = pool.run(_blocked, 2, str(tmp_path), True, timeout=90)
    assert seen_by_0 == ("recv", "started", None) or seen_by_0 == ("recv", "issued", None), seen_by_0
    assert seen == [signal.SIGTERM]
    d = json.loads((tmp_path / "rank1.json").read_text())  # the shutdown's dump keeps SIGTERM first
    assert d["reason"] == "SIGTERM" and d["reasons"] == ["SIGTERM", "shutdown"], d["reasons"]
    assert _recv_entry(d)[1] == "completed"


def test_sigterm_with_the_default_disposition_dumps_then_ends_the_rank_by_the_signal(pool, tmp_path):
    if not pool.capabilities()["survives_peer_failure"]:
        pytest.skip("MPI: mpirun ends the whole job when a rank dies")
    (s0, seen_by_0), (s1, _) = pool.run(_blocked, 2, str(tmp_path), False, timeout=90, raw=True)
    assert s0 == "ok" and seen_by_0 in (("recv", "started", None), ("recv", "issued", None)), (s0, seen_by_0)
    assert s1 == "died"  # SIGTERM's default action, after the dump
    d = json.loads((tmp_path / "rank1.json").read_text())
    assert d["reason"] == "SIGTERM" and "shutdown" not in d["reasons"], d["reasons"]


def _not_blocked(ctx, folder):
    """A handler set before the grid (replacing the engine's, if an earlier grid of this process
    installed it): the grid installs the engine's again, chaining to it."""
    prev = signal.getsignal(signal.SIGTERM)
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        grid = ctx.init(dp=1, flight_dir=folder)
        grid.all_reduce(torch.ones(2, device="cpu"), axis="dp")
        os.kill(os.getpid(), signal.SIGTERM)  # the Python handler runs before the next bytecode
        d = _dump(folder, 0)  # the engine's thread writes the dump meanwhile
        grid.shutdown()
        after = json.loads(open(os.path.join(folder, "rank0.json")).read())
        return seen, d is not None, after["reasons"]
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_sigterm_chains_to_a_python_handler_set_before_the_grid(pool, tmp_path):
    seen, dumped, reasons = pool.run(_not_blocked, 1, str(tmp_path))[0]
    assert seen == [signal.SIGTERM] and dumped
    assert reasons == ["SIGTERM", "shutdown"], reasons
