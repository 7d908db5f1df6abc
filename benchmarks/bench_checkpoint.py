"""Sharded checkpoints (issue 16): per-rank memory and time of a save on one grid and a load
on another, against the rank's shard size.

    python benchmarks/bench_checkpoint.py      # writes results/checkpoint.json and .png

A Llama (hidden 512, 8 layers, vocabulary 8192, fp32, with OffloadAdam's fp32 master weights
and Adam states: 4 tensors per parameter) is saved from dp2 x pp2 x row:2 and loaded into
cube:2 and into row:4 x pp2, 8 ranks each. Memory: the peak resident memory during the save or
load above the level just before it, sampled every millisecond by a thread reading
/proc/self/status, anonymous (the process's allocations) and file-backed (pages of the
memory-mapped shard files safetensors reads); "shard" is what the rank writes (save) or holds
once loaded (load). Times are the slowest rank's.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, start_worker

MODEL = dict(vocab=8192, hidden=512, heads=8, layers=8, seq=64, kv_heads=4, ffn_hidden=1376)
GRIDS = {"dp2 x pp2 x row:2": dict(dp=2, pp=2, tp="row:2"), "cube:2": dict(tp="cube:2"),
         "row:4 x pp2": dict(tp="row:4", pp=2)}


class PeakRSS:
    """Peak resident memory above the level at start, sampled every millisecond from
    /proc/self/status: anonymous (the process's own allocations) and file-backed (the pages of
    memory-mapped checkpoint files that safetensors reads, which the kernel can drop)."""

    def __init__(self):
        self.base = self._rss()
        self.peak = dict(self.base)
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def _rss():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) * 1024
        return out

    def _run(self):
        while not self._stop:
            now = self._rss()
            self.peak = {k: max(self.peak[k], now[k]) for k in now}
            time.sleep(0.001)

    def stop(self) -> tuple:
        self._stop = True
        self._t.join()
        return self.peak["RssAnon"] - self.base["RssAnon"], self.peak["RssFile"] - self.base["RssFile"]


def _stage(grid_kw):
    import torch

    import gridweave as gw

    kw = dict(grid_kw)
    tp = gw.modes.parse(kw.pop("tp", "none"))
    grid = gw.init(tp=tp, **kw)
    torch.manual_seed(0)
    model = gw.models.Llama(**MODEL, device=grid.device)
    stage = gw.models.GPTStage(model, grid, tp, grid.coords["pp"], grid.axes["pp"])
    del model
    opt = gw.optim.OffloadAdam(stage.parameters(), grid=grid)
    return grid, stage, opt


def worker(part: str, folder: str, out: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import gridweave as gw
    from gridweave.train import _state_views

    n, rank, _ = start_worker()
    grid, stage, opt = _stage(GRIDS[part])
    views = _state_views(opt)
    kinds = ("param",) + opt.STATE_KEYS
    items = stage.sharded_items()
    gc.collect()
    dist.barrier()
    if os.environ.get("GW_BENCH_MODE") == "save":
        shard = sum(p.numel() * p.element_size() + 3 * 4 * p.numel() for _, p, _ in items
                    if p.numel() and gw.placement_of(p).counted_here(grid))
        mem = PeakRSS()
        t0 = time.perf_counter()
        gw.checkpoint.save(folder, 1, items, grid, lambda p: {"param": p, **{k: v[id(p)] for k, v in views.items()}},
                           {"bench": True})
        dt = time.perf_counter() - t0
    else:
        shard = sum(p.numel() * (p.element_size() + 12) for p in stage.parameters())
        mem = PeakRSS()
        t0 = time.perf_counter()
        _, local = gw.checkpoint.load(folder, items, grid, kinds)
        dt = time.perf_counter() - t0
        del local
    anon, filed = mem.stop()
    row = torch.tensor([[float(shard), float(anon), float(filed), dt]], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(n)]
    dist.all_gather(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps([r[0].tolist() for r in rows]))
    gw.shutdown()


def plot(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels, shard, extra = [], [], []
    for case in data["cases"]:
        for r, row in enumerate(case["per_rank"]):
            labels.append(f"{case['what']}\nr{r}" if r == 0 else f"r{r}")
            shard.append(row["shard_bytes"] / 2 ** 20)
            extra.append(row["peak_extra_anon_bytes"] / 2 ** 20)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], shard, 0.4, label="shard (MiB)")
    ax.bar([i + 0.2 for i in x], extra, 0.4, label="peak anonymous memory above start (MiB)")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set(title="sharded checkpoint: per-rank memory during save / load", ylabel="MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main():
    import tempfile

    ap = bench_parser(__file__, parts=list(GRIDS))
    ap.add_argument("--folder")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.folder, args.out)
        return
    out = results_dir(args)
    folder = Path(tempfile.mkdtemp(prefix="gw-bench-ckpt-")) / "checkpoint"
    cases = []
    for what, part, port in (("save dp2 x pp2 x row:2", "dp2 x pp2 x row:2", 29851), ("load cube:2", "cube:2", 29853),
                             ("load row:4 x pp2", "row:4 x pp2", 29855)):
        os.environ["GW_BENCH_MODE"] = "save" if what.startswith("save") else "load"
        rows = run_ranks(__file__, 8, port, out, part.replace(" ", "").replace(":", ""), part, "--folder",
                         str(folder))
        per_rank = [{"shard_bytes": int(r[0]), "peak_extra_anon_bytes": int(r[1]), "peak_extra_file_bytes": int(r[2]),
                     "seconds": r[3]} for r in rows]
        cases.append({"what": what, "per_rank": per_rank, "seconds": max(r[3] for r in rows),
                      "max_anon_over_shard": max(r[1] / r[0] for r in rows if r[0]),
                      "max_file_over_shard": max(r[2] / r[0] for r in rows if r[0])})
        print(f"{what:24s} {cases[-1]['seconds']:.2f} s  peak above start / shard: anonymous max "
              f"{cases[-1]['max_anon_over_shard']:.2f}, mapped file pages max {cases[-1]['max_file_over_shard']:.2f}",
              flush=True)
    total = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    save(out, "checkpoint", {"model": MODEL, "bytes_on_disk": total, "cases": cases}, plot)


if __name__ == "__main__":
    main()
