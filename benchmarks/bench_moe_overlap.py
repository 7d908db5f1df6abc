"""The experts' dispatch overlapped with the shared expert (--moe-overlap, Megatron-Core's
shared-expert overlap) against today's exposed exchange, on an emulated cluster
(scripts/cluster.sh): 2 nodes x 4 ranks, each node's link limited (tbf, default 200 Mbit/s each
way; 50 Mbit/s here), loopback inside a node. A DeepSeek-V3-like model (latent attention, sigmoid routing, a
shared expert) with its 8 experts over ep 8 = dp 8, so each dispatch crosses the nodes. Side by
side in one run, alternating, each configuration three times: the median step time of each run
after its warm-up steps, and the losses (the overlap changes no value).

Linux and root (network namespaces). `python benchmarks/bench_moe_overlap.py [--rate 200mbit]`."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))
import cluster as cl  # noqa: E402
from launch import bench_parser, results_dir, save  # noqa: E402

# many tokens a rank (1024) and small experts: the rows' exchange, not the gradients' all-reduce,
# is what the links carry most; a wide shared expert to hide it behind
MODEL = dict(model="deepseek-v3", hidden=256, heads=8, layers=2, seq=128, batch=64, microbatches=1, experts=8,
             top_k=2, moe_ffn=64, shared_ffn=1536, aux_coef=0.0, bias_rate=0.001, dp=8, ep=8)
STEPS, WARMUP, REPEATS = 10, 3, 3
CONFIGS = {"exposed": [], "overlapped": ["--moe-overlap"]}


def flags() -> list:
    out = [x for k, v in MODEL.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return [*out, "--tokenizer", "bytes", "--steps", str(STEPS), "--val-every", "0", "--sample-tokens", "0",
            "--quiet", "--timeout", "120"]


def run_job(c, work: Path, name: str, extra: list, port: int) -> dict:
    out = work / f"{name}-{port}"
    procs = [c.popen(k, cl.train_cmd(c.n, k, c.addr(0), port, 4, [*flags(), *extra, "--out", out]),
                     work / f"{out.name}-{k}.log") for k in range(c.n)]
    codes = [p.wait(timeout=900) for p in procs]
    if codes != [0] * c.n:
        raise RuntimeError(f"{name}: exit {codes}: " + (work / f"{out.name}-0.log").read_text()[-2000:])
    m = json.loads((out / "metrics.json").read_text())
    tokens = MODEL["batch"] * MODEL["seq"]
    sent = m["traffic"]["sent_bytes"]
    return {"step_s": statistics.median(tokens / t for t in m["tokens_per_s"][WARMUP:]), "loss": m["loss"],
            "inter_bytes": sum(v["inter"] for v in sent.values())}


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for i, name in enumerate(CONFIGS):
        runs = data["runs"][name]["step_s"]
        ax.scatter([x * 1e3 for x in runs], [i] * len(runs))
    ax.set_yticks(range(len(CONFIGS)), list(CONFIGS))
    ax.set_xlabel("step time, ms (each run's median after warm-up)")
    ax.set_title(f"the experts' dispatch beside the shared expert: 2 nodes x 4 ranks, links {data['rate']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    args, work = cl.bench_setup(bench_parser(__file__), "bench_moe_overlap")
    data = {"rate": args.rate, "model": MODEL, "steps": STEPS, "warmup": WARMUP, "runs": {},
            "overlapped": "the shared expert's halves beside both exchanges: silu(gate x) * up x beside the "
                          "dispatch, down beside the combine, their backwards beside the reverses"}
    port = 29671
    with cl.Cluster(2, prefix="gwo", subnet="10.231.82", rate=args.rate) as c:
        for _ in range(REPEATS):  # side by side: each configuration once, then again
            for name, extra in CONFIGS.items():
                r = run_job(c, work, name, extra, port)
                port += 2
                row = data["runs"].setdefault(name, {"step_s": [], "loss": r["loss"], "inter_bytes": r["inter_bytes"]})
                row["step_s"].append(r["step_s"])
                print(f"{name:>11}: step {r['step_s'] * 1e3:8.1f} ms, inter-node {r['inter_bytes'] / 2**20:7.2f} MiB",
                      flush=True)
    med = {n: statistics.median(r["step_s"]) for n, r in data["runs"].items()}
    data["summary"] = {"exposed_over_overlapped_step": med["exposed"] / med["overlapped"],
                       "median_step_s": med,
                       "same_losses": data["runs"]["exposed"]["loss"] == data["runs"]["overlapped"]["loss"]}
    print(json.dumps(data["summary"], indent=1))
    save(results_dir(args), "moe_overlap", data, plot)


if __name__ == "__main__":
    main()
