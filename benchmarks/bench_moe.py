"""Issue 35, deliverable 6: the mixture-of-experts block's speed, side by side in one run.

    python benchmarks/bench_moe.py        # results/moe.json and .png

1. One process: gridweave's MoE block (gw.nn.DenseMoE) against transformers' own
   MixtralSparseMoeBlock with the same weights (its default experts implementation, torch's
   grouped_mm, and its eager loop), forward and backward of the same tokens, float32, in rounds
   (one variant after the other), tokens/s over the median round; the outputs compared.
2. Expert parallelism on the same ranks (4 and 8 CPU ranks, torchrun + Gloo): the block with its
   experts split over ep 1 (every rank holds all of them), 2, 4 (and 8) data-parallel ranks,
   forward and backward of each rank's own tokens, tokens/s of all ranks over the slowest rank's
   median round, the bytes each rank sent over ep, the parameter bytes each rank holds.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import bench_parser, interleaved_rounds, results_dir, run_ranks, save, start_worker  # noqa: E402

# Mixtral's shape, scaled to 2 cores: hidden 256, experts of 896 (its 14336 / 4096 ratio), 8 experts top-2
SIZES = dict(hidden=256, ffn=896, experts=8, top_k=2, tokens=2048)
ROUNDS, WARMUP = 8, 2


def one_process() -> list:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    import gridweave as gw

    torch.set_num_threads(1)
    h, t = SIZES["hidden"], SIZES["tokens"]
    cfg = MixtralConfig(hidden_size=h, intermediate_size=SIZES["ffn"], num_local_experts=SIZES["experts"],
                        num_experts_per_tok=SIZES["top_k"], router_jitter_noise=0.0)
    torch.manual_seed(0)
    with torch.device("cpu"):
        hf = {impl: MixtralSparseMoeBlock(MixtralConfig(**cfg.to_dict(), experts_implementation=impl))
              for impl in ("grouped_mm", "eager")}
    ref = hf["eager"]
    with torch.no_grad():  # a standalone block's experts are torch.empty (its model initialises them)
        for p in ref.parameters():
            p.normal_(0, 0.02)
    hf["grouped_mm"].load_state_dict(ref.state_dict())
    ours = gw.nn.DenseMoE(h, gw.nn.MoE(experts=SIZES["experts"], top_k=SIZES["top_k"], ffn=SIZES["ffn"]),
                          device="cpu")
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.gate_up.copy_(ref.experts.gate_up_proj)
        ours.down.copy_(ref.experts.down_proj)
    x = torch.randn(4, t // 4, h)
    variants = {"gridweave DenseMoE": ours, "transformers (grouped_mm)": hf["grouped_mm"],
                "transformers (eager)": ref}
    outs = {k: m(x).detach() for k, m in variants.items()}
    times = {k: [] for k in variants}
    for _ in range(WARMUP + ROUNDS):
        for k, m in variants.items():
            xi = x.clone().requires_grad_(True)
            t0 = time.perf_counter()
            m(xi).square().mean().backward()
            times[k].append(time.perf_counter() - t0)
            m.zero_grad(set_to_none=True)
    base = outs["transformers (eager)"]
    rows = [{"variant": k, "tokens_per_s": t / statistics.median(v[WARMUP:]),
             "max_abs_diff_vs_transformers": float((outs[k] - base).abs().max())} for k, v in times.items()]
    if not all(r["max_abs_diff_vs_transformers"] < 1e-5 for r in rows):
        raise SystemExit(f"the blocks disagree: {rows}")
    return rows


def worker(args):
    import torch

    import gridweave as gw
    from gridweave.grid import LinePart, Span

    n, rank, store = start_worker()
    h, t = SIZES["hidden"], SIZES["tokens"]
    moe = gw.nn.MoE(experts=SIZES["experts"], top_k=SIZES["top_k"], ffn=SIZES["ffn"])
    torch.manual_seed(0)
    dense = gw.nn.DenseMoE(h, moe, device="cpu")
    grid = gw.init(dp=n, store=store, prefix="moe")
    x = torch.randn(n, 4, t // 4, h, generator=torch.Generator().manual_seed(1))[rank]
    variants, sent, held = {}, {}, {}
    for ep in (e for e in (1, 2, 4, 8) if e <= n):
        axis = LinePart(("dp",), Span.WITHIN, ep)
        block = gw.nn.ExpertParallelMoE.from_dense(dense, grid, axis, ("dp",))

        def step(_, block=block):
            xi = x.clone().requires_grad_(True)
            block(xi).square().mean().backward()
            block.zero_grad(set_to_none=True)
            return 0.0

        variants[f"ep {ep}"] = (step, axis)
        held[f"ep {ep}"] = sum(p.numel() * p.element_size() for p in block.parameters())
    for key, (step, axis) in variants.items():  # connect every line, and the bytes of one step
        step(None)
        grid.reset_stats()
        step(None)
        label = next((k for k in grid.stats() if k != "dp"), None)
        s = grid.stats().get(label) if label else None
        sent[key] = (s["sent_intra"]["bytes"] + s["sent_inter"]["bytes"]) if s else 0
    times, _ = interleaved_rounds(variants, [None] * (WARMUP + ROUNDS))
    every = grid.all_gather_json({k: v[WARMUP:] for k, v in times.items()})
    if rank == 0:
        rows = []
        for key in variants:
            slowest = [max(r[key][i] for r in every) for i in range(ROUNDS)]
            rows.append({"ranks": n, "variant": key, "tokens_per_s": n * t / statistics.median(slowest),
                         "sent_bytes_per_rank_per_step": sent[key], "parameter_bytes_per_rank": held[key]})
        Path(args.out).write_text(__import__("json").dumps({"rows": rows}))
    gw.shutdown()


def plot(data: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    one = data["one_process"]
    a.barh([r["variant"] for r in one], [r["tokens_per_s"] for r in one], color=["C0", "C1", "C1"])
    a.set(xlabel="tokens/s (forward + backward)", title="one process, the same weights")
    for n in sorted({r["ranks"] for r in data["expert_parallel"]}):
        rows = [r for r in data["expert_parallel"] if r["ranks"] == n]
        b.plot([int(r["variant"].split()[1]) for r in rows], [r["tokens_per_s"] for r in rows], "o-",
               label=f"{n} ranks")
    b.set(xscale="log", xlabel="ep (experts split over)", ylabel="tokens/s, all ranks", title="expert parallelism")
    b.set_xticks([1, 2, 4, 8], [1, 2, 4, 8])
    b.legend()
    fig.suptitle(f"MoE block: hidden {SIZES['hidden']}, {SIZES['experts']} experts of {SIZES['ffn']}, top-"
                 f"{SIZES['top_k']}, {SIZES['tokens']} tokens a rank (CPU, float32)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main():
    ap = bench_parser(__file__)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = results_dir(args)
    data = {"sizes": SIZES, "rounds": ROUNDS, "one_process": one_process(), "expert_parallel": []}
    for n in (4, 8):
        data["expert_parallel"] += run_ranks(__file__, n, 29951 + n, out, f"moe{n}")["rows"]
    save(out, "moe", data, plot)
    for r in data["one_process"]:
        print(f"{r['variant']:28s} {r['tokens_per_s']:9.0f} tok/s  max |diff| {r['max_abs_diff_vs_transformers']:.1e}")
    for r in data["expert_parallel"]:
        print(f"{r['ranks']} ranks {r['variant']:6s} {r['tokens_per_s']:9.0f} tok/s  "
              f"{r['sent_bytes_per_rank_per_step'] / 2 ** 20:7.2f} MiB sent a rank  "
              f"{r['parameter_bytes_per_rank'] / 2 ** 20:6.2f} MiB of parameters a rank")


if __name__ == "__main__":
    main()
