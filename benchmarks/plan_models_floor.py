"""How close bench_plan_models' goals sit to its measurement's own noise: each drawn shape's
grids are timed in two rounds minutes apart (each grid built afresh); here round one's median
step stands in for a prediction of round two's, scored as the planner is (median and worst
|error| over the grids, Kendall's tau per shape, the regret of round one's fastest grid in
round two). A planner cannot be held, on one draw, to goals the measurement misses against
itself.

    python benchmarks/plan_models_floor.py results/plan_models_draw2*.json   # writes results/plan_models_floor.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_plan import name as label
from bench_plan_models import STEPS, goals_met


def floor(data: dict) -> dict:
    """Round one against round two over a draw's shapes (the reported ones, never FIT's)."""
    from scipy.stats import kendalltau

    errors, taus, regrets = [], [], []
    for model in data["models"]:
        rows = [r for r in data["rows"] if r["model"] == model and len(r["steps_s"]) >= 2 * STEPS]
        if model in data["fit"] or len(rows) < 2:
            continue
        first = {label(r): statistics.median(r["steps_s"][:STEPS]) for r in rows}
        second = {label(r): statistics.median(r["steps_s"][STEPS:2 * STEPS]) for r in rows}
        errors += [first[k] / second[k] - 1 for k in first]
        taus.append(kendalltau([first[k] for k in first], [second[k] for k in first]).statistic)
        regrets.append(second[min(first, key=first.get)] / min(second.values()) - 1)
    out = {"grids": len(errors), "median_abs_error": statistics.median(abs(e) for e in errors),
           "worst_abs_error": max(abs(e) for e in errors), "median_kendall_tau": statistics.median(taus),
           "worst_regret": max(regrets)}
    out["goals_met"] = goals_met(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draws", nargs="+", help="bench_plan_models --draw results (JSON)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_models_floor.json"))
    args = ap.parse_args()
    report = {}
    for path in sorted(args.draws):
        data = json.loads(Path(path).read_text())
        if "draw" not in data or "summary" not in data:
            continue
        report[str(data["draw"]["seed"])] = {"rounds": floor(data), "planner": data["summary"]["reported"]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'draw':>5s}  {'round one against two':>36s}   {'the planner':>36s}")
    for seed, r in report.items():
        print(f"{seed:>5s}  " + "   ".join(
            f"{100 * s['median_abs_error']:5.1f}% {100 * s['worst_abs_error']:5.1f}% tau {s['median_kendall_tau']:.2f} "
            f"regret {100 * s['worst_regret']:4.1f}%" for s in (r["rounds"], r["planner"])))


if __name__ == "__main__":
    main()
