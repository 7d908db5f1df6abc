"""The flight recorder's cost: the engine's cheapest ops with the recorder off
(GRIDWEAVE_FLIGHT_ENTRIES=0) and on (its default ring).

    python benchmarks/bench_flight.py [--ranks 1,2] [--ops 20000] [--launches 4]
    GRIDWEAVE_FLIGHT_ENTRIES=0 torchrun --nproc-per-node N benchmarks/bench_flight.py --worker

The same small all_reduces (one float: the op whose own cost is smallest, so the recorder's share
is largest) run in jobs launched alternately with the recorder off and on, `--launches` jobs of
each, `ops / launches` ops a job in rounds. One grid a process: two grids in one process do not
run alike (measured: whichever grid was made first ran its async ops 6x faster, recorder or not).
Two paths: the synchronous one-call host path (what a training step's small reductions take) and
an async op waited on (a Work handed to the worker thread: every stamp the recorder makes). One
rank is the engine alone (a one-member line copies locally); two ranks add Gloo's messages.
Writes results/flight_overhead.json: per path the median (and the fastest) per-op time of the
rounds, off and on; and, when the C++ benchmarks are built (build/*/benchmarks/bench_flight_ring),
the recorder's own cost per op on one thread without communication (what no machine noise hides)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from launch import bench_parser, results_dir, run_ranks, save, start_worker

ROUNDS = 5  # a job's


def worker(out_path: str, ops: int) -> None:
    import torch
    import torch.distributed as dist

    import gridweave as gw

    n, rank, store = start_worker()
    grid = gw.init(dp=n, store=store, prefix="flight")  # the recorder as GRIDWEAVE_FLIGHT_ENTRIES says
    t = torch.ones(1, device="cpu")
    paths = {
        "all_reduce, one call (sync)": lambda: grid.all_reduce(t, axis="dp"),
        "all_reduce, async + wait": lambda: grid.all_reduce(t, axis="dp", async_op=True).wait(),
    }
    per_round = max(1, ops // ROUNDS)
    times = {}
    for name, call in paths.items():
        for _ in range(200):  # warm: the line made, the caches filled
            call()
        times[name] = []
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_round):
                call()
            times[name].append((time.perf_counter() - t0) / per_round)
    recorded = len(grid.flight_records())
    grid.shutdown()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ranks": n, "times": times, "recorded": recorded}))
    dist.destroy_process_group()


def ring_cost(binary: Path) -> dict:
    """bench_flight_ring's medians: a Work stamped without a recorder, and with one (ns an op)."""
    out = subprocess.run([str(binary), "--benchmark_format=json", "--benchmark_repetitions=9",
                          "--benchmark_report_aggregates_only=true"], check=True, capture_output=True, text=True)
    med = {b["run_name"]: b["real_time"] for b in json.loads(out.stdout)["benchmarks"]
           if b.get("aggregate_name") == "median"}
    root = Path(__file__).resolve().parents[1]
    where = binary.resolve().relative_to(root) if binary.resolve().is_relative_to(root) else binary.name
    return {"binary": str(where), "off_ns": med["BM_WorkOff"], "on_ns": med["BM_WorkOn"],
            "per_op_ns": med["BM_WorkOn"] - med["BM_WorkOff"]}


def main() -> None:
    ap = bench_parser(__file__)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--ops", type=int, default=20000, help="ops a path runs with the recorder off, and on")
    ap.add_argument("--launches", type=int, default=4, help="jobs of each variant, launched alternately")
    ap.add_argument("--ring-bench", default=None, help="bench_flight_ring (default: the first build/*/benchmarks/ one)")
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.ops)
        return
    out = results_dir(args)
    rows = []
    for n in [int(v) for v in args.ranks.split(",")]:
        got = {"off": [], "on": []}
        for k in range(args.launches):
            for variant in ("off", "on") if k % 2 == 0 else ("on", "off"):
                if variant == "off":
                    os.environ["GRIDWEAVE_FLIGHT_ENTRIES"] = "0"
                else:
                    os.environ.pop("GRIDWEAVE_FLIGHT_ENTRIES", None)
                got[variant].append(run_ranks(__file__, n, 29531, out, f"{n}{variant}", "--ops",
                                              str(args.ops // args.launches), transport=args.transport))
        os.environ.pop("GRIDWEAVE_FLIGHT_ENTRIES", None)
        assert all(j["recorded"] == 0 for j in got["off"]) and all(j["recorded"] > 0 for j in got["on"])
        for path in got["off"][0]["times"]:
            off = [x for j in got["off"] for x in j["times"][path]]
            on = [x for j in got["on"] for x in j["times"][path]]
            off_s, on_s = statistics.median(off), statistics.median(on)
            rows.append({"ranks": n, "path": path, "ops_each": args.ops // args.launches // ROUNDS * ROUNDS *
                         args.launches, "launches": args.launches, "rounds": len(off),
                         "off_us": off_s * 1e6, "on_us": on_s * 1e6, "overhead_us": (on_s - off_s) * 1e6,
                         "overhead_ratio": on_s / off_s - 1.0,
                         # the fastest round: what the op costs when the machine's other work leaves it alone
                         "off_min_us": min(off) * 1e6, "on_min_us": min(on) * 1e6,
                         "off_rounds_us": [x * 1e6 for x in off], "on_rounds_us": [x * 1e6 for x in on]})
    result = {"what": "per-op time of a one-float all_reduce with the flight recorder off "
                      "(GRIDWEAVE_FLIGHT_ENTRIES=0) and on (its default 2048 entries), jobs of each launched "
                      "alternately; median of the rounds",
              "cpus": os.cpu_count(), "rows": rows}
    found = [Path(args.ring_bench)] if args.ring_bench else \
        sorted(Path(__file__).resolve().parents[1].glob("build/*/benchmarks/bench_flight_ring"))
    if found:
        result["ring"] = ring_cost(found[0])
        print(f"the recorder alone, one thread: {result['ring']['per_op_ns']:.0f} ns an op "
              f"({result['ring']['on_ns']:.0f} vs {result['ring']['off_ns']:.0f} ns for a Work's stamps)")
    save(out, "flight_overhead", result)
    for r in rows:
        print(f"n={r['ranks']} {r['path']:28s} median off {r['off_us']:7.2f} us  on {r['on_us']:7.2f} us  "
              f"overhead {r['overhead_us']:+.2f} us ({r['overhead_ratio']:+.1%}); fastest round off "
              f"{r['off_min_us']:7.2f} us  on {r['on_min_us']:7.2f} us")


if __name__ == "__main__":
    main()
