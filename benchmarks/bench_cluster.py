"""Topology where it matters, on an emulated cluster (scripts/cluster.sh): 2 nodes x 4 ranks, the
links between nodes limited (tbf, default 200 Mbit/s each way), loopback inside nodes. Side by
side in one run, each configuration twice, interleaved:

- SUPER's topology-aware placement against naive, on a sub-graph grid (dp 4 x sg 2) and on a
  dp x tp grid (dp 2 x tp row:4): inter-node bytes (the engine's counters, the kernel's link
  counters beside them) and step time;
- Bian et al.'s 3-D layer (tp cube:2) against the 1-D layer (tp row:8) on all 8 ranks: step time,
  and the planner's prediction of both after calibrating on this cluster (gridweave bench
  --calibrate under torchrun on both nodes: alpha and beta inside a node and between nodes);
- the time an elastic job takes from a killed rank to training again (--max-restarts 1).

Linux and root (network namespaces). `python benchmarks/bench_cluster.py [--rate 200mbit]`."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
import cluster as cl  # noqa: E402
from launch import bench_parser, results_dir, save  # noqa: E402

MODEL = dict(hidden=256, heads=8, kv_heads=8, layers=2, seq=128, batch=16, microbatches=1)
STEPS, WARMUP = 8, 3
CONFIGS = {  # name: (flags, which comparison)
    "sg2 topology": (["--dp", "4", "--tp", "subgraph:2", "--placement", "topology"], "placement, sub-graph"),
    "sg2 naive": (["--dp", "4", "--tp", "subgraph:2", "--placement", "naive"], "placement, sub-graph"),
    "row4 topology": (["--dp", "2", "--tp", "row:4", "--placement", "topology"], "placement, dp x tp"),
    "row4 naive": (["--dp", "2", "--tp", "row:4", "--placement", "naive"], "placement, dp x tp"),
    "3-D cube:2": (["--dp", "1", "--tp", "cube:2"], "3-D vs 1-D"),
    "1-D row:8": (["--dp", "1", "--tp", "row:8"], "3-D vs 1-D"),
}


def model_flags(steps=STEPS) -> list:
    flags = [x for k, v in MODEL.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [*flags, "--steps", str(steps), "--val-every", "0", "--sample-tokens", "0", "--quiet", "--timeout", "120"]


def run_job(c, work: Path, name: str, flags: list, port: int) -> dict:
    out = work / name.replace(" ", "_").replace(":", "")
    before = [c.tx_bytes(k) for k in range(c.n)]
    procs = [c.popen(k, cl.train_cmd(c.n, k, c.addr(0), port, 4, [*model_flags(), *flags, "--out", out]),
                     work / f"{out.name}-{k}.log") for k in range(c.n)]
    codes = [p.wait(timeout=900) for p in procs]
    if codes != [0] * c.n:
        raise RuntimeError(f"{name}: exit {codes}: " + (work / f"{out.name}-0.log").read_text()[-2000:])
    tx = sum(c.tx_bytes(k) for k in range(c.n)) - sum(before)
    m = json.loads((out / "metrics.json").read_text())
    tokens = MODEL["batch"] * MODEL["seq"]
    step_s = statistics.median(tokens / t for t in m["tokens_per_s"][WARMUP:])
    sent = m["traffic"]["sent_bytes"]
    return {"step_s": step_s, "inter_bytes": sum(v["inter"] for v in sent.values()),
            "intra_bytes": sum(v["intra"] for v in sent.values()), "kernel_tx_bytes": tx, "per_axis": sent,
            "loss": m["loss"]}


def calibrate(c, work: Path, port: int) -> dict:
    """gridweave bench --calibrate on both nodes at once, under torchrun (a user's own launcher)."""
    out = work / "preset.json"
    procs = [c.popen(k, [sys.executable, "-m", "torch.distributed.run", "--nnodes", c.n, "--node-rank", k,
                         "--master-addr", c.addr(0), "--master-port", port, "--nproc-per-node", 4,
                         "-m", "gridweave.cli", "bench", "--calibrate", "--out", out], work / f"calibrate-{k}.log",
                     env={"OMP_NUM_THREADS": "1"}) for k in range(c.n)]
    codes = [p.wait(timeout=900) for p in procs]
    if codes != [0] * c.n:
        raise RuntimeError("calibration failed: " + (work / "calibrate-0.log").read_text()[-2000:])
    return json.loads(out.read_text())


def predict(preset: dict, flags: list) -> float:
    import gridweave as gw
    from gridweave import plan
    from gridweave.cli import parse_train

    cluster = plan.Cluster.of(preset)
    cfg = parse_train([*model_flags(), *flags])  # the job as the command line makes it
    return gw.train.plan_job(cfg, cfg.grid_shape(8), cluster)["step_time_s"]


def recovery(c, work: Path, port: int) -> dict:
    """An elastic job (--max-restarts 1 --resume auto) with one rank killed after its first
    checkpoint: seconds from the kill to the restarted job's "resumed" line, and to its end."""
    out = work / "elastic"
    flags = [*model_flags(steps=40), "--dp", "2", "--tp", "row:4", "--checkpoint-every", "4", "--sync-save",
             "--resume", "auto", "--max-restarts", "1", "--out", out]
    logs = [work / f"elastic-{k}.log" for k in range(c.n)]
    procs = [c.popen(k, cl.train_cmd(c.n, k, c.addr(0), port, 4, flags), logs[k]) for k in range(c.n)]
    while not (out / "checkpoint" / "latest").exists():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("elastic job ended early: " + logs[0].read_text()[-2000:])
        time.sleep(0.05)
    victim = c.worker_pids(1)[0]
    t0 = time.monotonic()
    os.kill(victim, 9)
    resumed = None
    while any(p.poll() is None for p in procs):
        if resumed is None and "resumed from step" in logs[0].read_text(errors="replace"):
            resumed = time.monotonic() - t0
        time.sleep(0.05)
    if [p.returncode for p in procs] != [0] * c.n:
        raise RuntimeError("elastic job failed: " + logs[0].read_text()[-2000:])
    line = next(x for x in logs[0].read_text().splitlines() if "resumed from step" in x)
    return {"fault_to_resumed_s": resumed, "fault_to_end_s": time.monotonic() - t0, "resumed": line}


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(CONFIGS)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    step = [statistics.median(data["runs"][n]["step_s"]) for n in names]
    inter = [data["runs"][n]["inter_bytes"] / 2 ** 20 for n in names]
    axes[0].barh(names, step)
    axes[0].set_xlabel("step time, s (median of 2 runs)")
    axes[1].barh(names, inter, color="tab:orange")
    axes[1].set_xlabel("inter-node bytes per job, MiB (engine counters)")
    fig.suptitle(f"2 nodes x 4 ranks, links {data['rate']} (emulated cluster)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    args, work = cl.bench_setup(bench_parser(__file__), "bench_cluster")
    data = {"rate": args.rate, "model": MODEL, "steps": STEPS, "warmup": WARMUP, "runs": {}}
    with cl.Cluster(2, prefix="gwb", subnet="10.231.81", rate=args.rate) as c:
        data["preset"] = calibrate(c, work, 29660)
        port = 29661
        for rep in range(2):  # side by side: every configuration once, then again
            for name, (flags, _) in CONFIGS.items():
                r = run_job(c, work, name, flags, port)
                port += 1
                row = data["runs"].setdefault(name, {"step_s": [], "comparison": CONFIGS[name][1]})
                row["step_s"].append(r.pop("step_s"))
                row.update(r)
                print(f"{name:>14}: step {row['step_s'][-1] * 1e3:8.1f} ms, inter-node {r['inter_bytes'] / 2**20:7.2f} "
                      f"MiB (kernel {r['kernel_tx_bytes'] / 2**20:7.2f} MiB)", flush=True)
        data["recovery"] = recovery(c, work, port + 1)
    for name, (flags, _) in CONFIGS.items():
        data["runs"][name]["predicted_step_s"] = predict(data["preset"], flags)
    med = {n: statistics.median(r["step_s"]) for n, r in data["runs"].items()}
    pred = {n: r["predicted_step_s"] for n, r in data["runs"].items()}
    data["summary"] = {
        "naive_over_topology_step_sg2": med["sg2 naive"] / med["sg2 topology"],
        "naive_over_topology_step_row4": med["row4 naive"] / med["row4 topology"],
        "inter_bytes_sg2": {p: data["runs"][f"sg2 {p}"]["inter_bytes"] for p in ("naive", "topology")},
        "inter_bytes_row4": {p: data["runs"][f"row4 {p}"]["inter_bytes"] for p in ("naive", "topology")},
        "one_d_over_three_d_step_measured": med["1-D row:8"] / med["3-D cube:2"],
        "one_d_over_three_d_step_predicted": pred["1-D row:8"] / pred["3-D cube:2"],
        "fault_to_resumed_s": data["recovery"]["fault_to_resumed_s"],
    }
    print(json.dumps(data["summary"], indent=1))
    save(results_dir(args), "cluster", data, plot)


if __name__ == "__main__":
    main()
