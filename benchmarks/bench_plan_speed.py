"""How long gw.plan takes to rank every grid at the scales users plan for (issue 34,
deliverable 6): Narayanan et al.'s 1.7B GPT on 32 A100s and 1T GPT on 3072 (their Table 1's
first and last rows), every tensor mode, sp, pp, dp, placement and ZeRO stage, micro-batch
sizes 1-16, full recomputation, in one process and in workers (plan's default on this machine).

    python benchmarks/bench_plan_speed.py [--skip-1t-alone]   # results/plan_speed.json

Wall seconds, the grids and ranked rows, the first choice, and whether the workers' ranking
equals the one process's (every row, in order).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from launch import save

from gridweave import plan
from gridweave.models import ModelConfig

# (name, GPUs, hidden, layers, heads, global batch): Narayanan et al. 2021, Table 1
MODELS = [("1.7B", 32, 2304, 24, 24, 512), ("1T", 3072, 25600, 128, 160, 3072)]


def timed(n, model, cluster, workers):
    t = time.perf_counter()
    rows = plan.plan(n, model, cluster, workers=workers, recompute=True)
    return time.perf_counter() - t, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--skip-1t-alone", action="store_true", help="the 1T plan in workers only (minutes less)")
    args = ap.parse_args()
    a100 = plan.load_cluster("a100-ib")
    cores = len(os.sched_getaffinity(0))
    out = {"cores": cores, "cluster": a100.name, "models": {}}
    for name, n, hidden, layers, heads, batch in MODELS:
        model = plan.Model(ModelConfig("gpt", 51200, hidden=hidden, heads=heads, layers=layers, seq=2048), batch=batch)
        row = {"gpus": n, "grids": len(plan.enumerate_grids(n, model))}
        t_workers, rows = timed(n, model, a100, None)
        row.update(workers_s=t_workers, rows=len(rows))
        r = rows[0]
        row["first_choice"] = {k: r[k] for k in ("dp", "pp", "tp", "sp", "zero", "placement", "microbatches",
                                                 "step_time_s")}
        if not (args.skip_1t_alone and n > 1024):
            t_alone, alone = timed(n, model, a100, 1)
            row.update(alone_s=t_alone, same_ranking=alone == rows)
        out["models"][name] = row
        print(name, row, flush=True)
    save(Path(args.out), "plan_speed", out)


if __name__ == "__main__":
    main()
