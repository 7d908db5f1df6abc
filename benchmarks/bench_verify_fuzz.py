"""The fuzzer's run: `gridweave verify --fuzz N --seed S` (random configurations train accepts,
each verified against one process in float64), its lines kept and summed up in
benchmarks/results/verify_fuzz.json (the guide quotes it).

    python3 benchmarks/bench_verify_fuzz.py --fuzz 60 --seed 2026
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fuzz", type=int, default=60)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "verify_fuzz.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    ran = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", "--fuzz", str(args.fuzz), "--seed",
                          str(args.seed), "--ranks", str(args.ranks)], capture_output=True, text=True)
    lines = ran.stdout.splitlines()
    runs, repros = [], {}
    for line in lines:
        m = re.match(r"fuzz (\d+)/\d+: (.*?): (verify: .*|error: .*)$", line)
        if m:
            worst = re.search(r"the largest difference ([0-9.e+-]+)\)", m.group(3))
            runs.append({"index": int(m.group(1)), "config": m.group(2), "result": m.group(3),
                         "ok": m.group(3).startswith("verify: ok"), "worst": float(worst.group(1)) if worst else None})
        elif line.startswith("  repro: "):
            repros[runs[-1]["index"]] = line[len("  repro: "):]
    for r in runs:
        if r["index"] in repros:
            r["repro"] = repros[r["index"]]
    summary = {"configurations": len(runs), "seed": args.seed, "ranks": args.ranks,
               "ok": sum(r["ok"] for r in runs), "failed": sum(not r["ok"] for r in runs),
               "worst": max((r["worst"] for r in runs if r["worst"] is not None), default=0.0),
               "seconds": round(time.perf_counter() - t0, 1), "exit_code": ran.returncode,
               "families": sorted({r["config"].split(" on ")[0] for r in runs}), "runs": runs}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(lines[-1] if lines else ran.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
