"""A pool of rank processes kept alive across tests (importing torch costs seconds per
process on a 2-core machine). Each test ships a module-level function to the first n
workers; they rendezvous through one TCPStore under a fresh key prefix."""
from __future__ import annotations

import itertools
import os
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from datetime import timedelta


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
        return gw.init(rank=self.rank, world_size=self.world_size, store=self._store, prefix=self.prefix, **kw)


def _worker(conn, host: str, port: int) -> None:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    if os.environ.get("GRIDWEAVE_TEST_DEFAULT_DEVICE"):  # conftest's --default-device
        torch.set_default_device(os.environ["GRIDWEAVE_TEST_DEFAULT_DEVICE"])
    import gridweave as gw

    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    while True:
        try:
            task = conn.recv()
        except EOFError:
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


class RemoteError(AssertionError):
    pass


class RankPool:
    def __init__(self, size: int = 8):
        from torch.distributed import TCPStore

        self.size = size
        self._ctx = mp.get_context("spawn")
        self.host = "127.0.0.1"
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        self.port = self._store.port
        self._ids = itertools.count()
        self._workers = [self._spawn() for _ in range(size)]

    def _spawn(self):
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker, args=(child, self.host, self.port), daemon=True)
        p.start()
        child.close()
        return p, parent

    def _respawn(self, i: int) -> None:
        p, conn = self._workers[i]
        if p.is_alive():
            p.kill()
        p.join(5)
        conn.close()
        self._workers[i] = self._spawn()

    def run(self, fn, n: int, *args, timeout: float = 120.0, raw: bool = False, **kwargs):
        """Run fn(ctx, *args, **kwargs) on ranks 0..n-1; return their results in rank order.
        raw=True returns ("ok"|"err"|"died", value) per rank instead of raising."""
        assert 1 <= n <= self.size
        prefix = f"test{next(self._ids)}"
        for r in range(n):
            if not self._workers[r][0].is_alive():
                self._respawn(r)
            self._workers[r][1].send((fn, RankContext(r, n, self.host, self.port, prefix), args, kwargs))
        results = []
        for r in range(n):
            p, conn = self._workers[r]
            try:
                if conn.poll(timeout):
                    results.append(conn.recv())
                else:
                    results.append(("died", f"rank {r}: no answer in {timeout} s"))
                    self._respawn(r)
            except (EOFError, ConnectionError, OSError):
                results.append(("died", f"rank {r}: process exited"))
                self._respawn(r)
        if raw:
            return results
        errors = [v for s, v in results if s != "ok"]
        if errors:
            raise RemoteError("\n".join(errors))
        return [v for _, v in results]

    def close(self):
        for p, conn in self._workers:
            try:
                conn.send(None)
            except OSError:
                pass
        for p, _ in self._workers:
            p.join(5)
            if p.is_alive():
                p.kill()
