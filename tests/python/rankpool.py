"""A pool of rank processes kept alive across tests (importing torch costs seconds per
process on a 2-core machine). Each test ships a module-level function to the first n
workers; they rendezvous through one TCPStore under a fresh key prefix.

The pool is parameterised by transport (pytest --transport): "gloo" spawns its workers with
multiprocessing, each one replaced alone when it dies; "mpi" starts them with one mpirun
job (MPI's world of 8; a test's grid is its first n ranks; no store: MPI connects the
lines), which MPI ends as a whole when one rank dies, so the whole job is started again."""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Listener

TRANSPORT_ENV = "GRIDWEAVE_TEST_TRANSPORT"
READY = "ready"
TRANSPORTS = ("gloo", "mpi")


@dataclass
class RankContext:
    rank: int
    world_size: int
    host: str
    port: int
    prefix: str
    _store: object = None

    @property
    def store(self):
        return self._store

    def init(self, **kw):
        import gridweave as gw

        kw.setdefault("timeout", 30.0)
        device = os.environ.get("GRIDWEAVE_TEST_DEVICE", "cpu")
        if device != "cpu":  # the GPU tier: every rank on the GPU, shared through Gloo
            kw.setdefault("device", device)
            kw.setdefault("backend", "gloo")
        if os.environ.get(TRANSPORT_ENV) == "mpi":
            kw.setdefault("backend", "mpi")
        return gw.init(rank=self.rank, world_size=self.world_size, store=self._store, prefix=self.prefix, **kw)


def _serve(conn, host: str, port: int) -> None:
    """A worker's life: run the tasks `conn` brings until it closes."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    if os.environ.get("GRIDWEAVE_TEST_DEFAULT_DEVICE"):  # conftest's --default-device
        torch.set_default_device(os.environ["GRIDWEAVE_TEST_DEFAULT_DEVICE"])
    import gridweave as gw

    # MPI connects its ranks itself: no store (a grid then makes its own, never read)
    mpi = os.environ.get(TRANSPORT_ENV) == "mpi"
    store = None if mpi else TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    conn.send(READY)  # imported and connected: a task given now starts at once, as its peers' do
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, ctx, args, kwargs = task
        ctx._store = store
        try:
            conn.send(("ok", fn(ctx, *args, **kwargs)))
        except BaseException as e:  # ship any failure back to the test
            conn.send(("err", f"rank {ctx.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            try:
                gw.shutdown()
            except Exception:
                pass


def _worker(conn, host: str, port: int) -> None:
    _serve(conn, host, port)


def _mpi_worker() -> None:
    """A rank of the pool's mpirun job: call the pool back, say which rank, then serve."""
    host, port, address = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import gridweave as gw

    rank, _ = gw.launch.mpi_world()  # MPI_Init is collective over the whole job: every rank, first
    addr_host, addr_port = address.rsplit(":", 1)
    conn = Client((addr_host, int(addr_port)), authkey=bytes.fromhex(os.environ["GRIDWEAVE_POOL_KEY"]))
    conn.send(rank)
    _serve(conn, host, port)


# What torchrun puts in a rank's environment: a job under mpirun must not inherit it.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def mpirun_env(**extra) -> dict:
    """This environment for ranks started by mpirun: without torchrun's variables, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def mpirun(n: int, argv: list, timeout: float, **extra_env):
    """`python ARGV` on n ranks under mpirun (no stdin: mpirun forwards it); output captured."""
    import gridweave as gw

    return subprocess.run(gw.launch.mpirun_command(n) + [sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout, env=mpirun_env(**extra_env), stdin=subprocess.DEVNULL)


def launcher_args() -> list:
    """How the tests' main jobs (gridweave train --nproc N) spawn their ranks on this run's
    transport."""
    return ["--launcher", "mpirun" if os.environ.get(TRANSPORT_ENV) == "mpi" else "torchrun"]


class RemoteError(AssertionError):
    pass


class RankPool:
    def __init__(self, size: int = 8, transport: str = "gloo"):
        from torch.distributed import TCPStore

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.size = size
        self.transport = transport
        self._ctx = mp.get_context("spawn")
        self.host = "127.0.0.1"
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        self.port = self._store.port
        self._ids = itertools.count()
        self._caps = None
        self._job = None  # the mpirun process (transport "mpi")
        if transport == "mpi":
            self._key = secrets.token_bytes(16)
            self._listener = Listener((self.host, 0), backlog=size, authkey=self._key)  # all connect at once
            self._conns = self._start_job()
        else:
            self._fresh = set()  # pids of workers not yet known ready
            self._workers = [self._spawn() for _ in range(size)]

    # ---- gloo: one multiprocessing worker per rank ------------------------------------
    def _spawn(self):
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker, args=(child, self.host, self.port), daemon=True)
        p.start()
        child.close()
        self._fresh.add(p.pid)
        return p, parent

    @staticmethod
    def _await_ready(conn, timeout: float = 180.0) -> None:
        """A new worker imports torch for seconds: a task waits for it, or a test's short timeouts
        (its peers already connecting) would count the import."""
        if not conn.poll(timeout) or conn.recv() != READY:
            raise RuntimeError(f"a new pool worker was not ready within {timeout} s")

    # ---- mpi: one mpirun job of `size` ranks ------------------------------------------
    def _start_job(self):
        import gridweave as gw

        here = os.path.dirname(os.path.abspath(__file__))
        env = mpirun_env(GRIDWEAVE_POOL_KEY=self._key.hex(),
                         PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
        addr = "%s:%d" % self._listener.address
        self._job = subprocess.Popen(gw.launch.mpirun_command(self.size) + [
            sys.executable, "-c", "import rankpool; rankpool._mpi_worker()", self.host, str(self.port), addr],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # mpirun forwards stdin: none here
        conns = [None] * self.size
        for _ in range(self.size):
            c = self._listener.accept()
            conns[c.recv()] = c
        for c in conns:
            self._await_ready(c)
        return conns

    def _stop_job(self):
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass
        if self._job is not None:
            self._job.kill()
            self._job.wait(30)

    # ---- both -------------------------------------------------------------------------
    def _conn(self, r: int):
        return self._conns[r] if self.transport == "mpi" else self._workers[r][1]

    def _alive(self, r: int) -> bool:
        if self.transport == "mpi":
            return self._job.poll() is None
        return self._workers[r][0].is_alive()

    def _replace(self, r: int) -> None:
        """After rank r died or hung: a new worker for it (gloo), a new job (mpi)."""
        if self.transport == "mpi":
            self._stop_job()
            self._conns = self._start_job()
            return
        p, conn = self._workers[r]
        if p.is_alive():
            p.kill()
        p.join(5)
        conn.close()
        self._workers[r] = self._spawn()

    def capabilities(self) -> dict:
        """What this pool's transport can do (grid.capabilities of a 2-rank world)."""
        if self._caps is None:
            self._caps = self.run(_capabilities, 2)[0]
        return self._caps

    def run(self, fn, n: int, *args, timeout: float = 120.0, raw: bool = False, **kwargs):
        """Run fn(ctx, *args, **kwargs) on ranks 0..n-1; return their results in rank order.
        raw=True returns ("ok"|"err"|"died", value) per rank instead of raising."""
        assert 1 <= n <= self.size
        prefix = f"test{next(self._ids)}"
        for r in range(n):
            if not self._alive(r):
                self._replace(r)
        if self.transport != "mpi":
            for p, conn in self._workers[:n]:
                if p.pid in self._fresh:
                    self._await_ready(conn)
                    self._fresh.discard(p.pid)
        for r in range(n):
            self._conn(r).send((fn, RankContext(r, n, self.host, self.port, prefix), args, kwargs))
        results, lost = [], []
        for r in range(n):
            conn = self._conn(r)
            try:
                if conn.poll(timeout):
                    results.append(conn.recv())
                else:
                    results.append(("died", f"rank {r}: no answer in {timeout} s"))
                    lost.append(r)
            except (EOFError, ConnectionError, OSError):
                results.append(("died", f"rank {r}: process exited"))
                lost.append(r)
        for r in lost[:1] if self.transport == "mpi" else lost:
            self._replace(r)
        if raw:
            return results
        errors = [v for s, v in results if s != "ok"]
        if errors:
            raise RemoteError("\n".join(errors))
        return [v for _, v in results]

    def close(self):
        conns = self._conns if self.transport == "mpi" else [c for _, c in self._workers]
        for conn in conns:
            try:
                conn.send(None)
            except OSError:
                pass
        if self.transport == "mpi":
            try:
                self._job.wait(30)
            except subprocess.TimeoutExpired:
                self._job.kill()
            self._listener.close()
            return
        for p, _ in self._workers:
            p.join(5)
            if p.is_alive():
                p.kill()


def _capabilities(ctx):
    grid = ctx.init(dp=ctx.world_size)
    caps = grid.capabilities()
    grid.barrier()  # both ends connected before either closes: a rank done first closed under its peer
    return caps
