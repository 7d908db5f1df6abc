"""Issue 28's GPU count: host synchronisations and cudaMalloc / cudaFree calls per training
step (the main job's model, one GPU, NCCL at world size 1), from torch's profiler. Goal: none
per collective or message. Writes host_syncs_<device>.json under --out."""
import argparse
import json
import os
from collections import Counter

import torch

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import gridweave as gw

    cfg = gw.train.TrainConfig(steps=args.steps, tokenizer="bytes", backend="nccl", dp=1, pp=1, device="cuda")
    grid = gw.init(backend="nccl")
    model_cfg = cfg.model_config(256)
    _, stage, opt, scaler = gw.train.build(cfg, grid, model_cfg)
    x = torch.randint(0, 256, (cfg.batch, cfg.seq), device="cpu")
    gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))  # warm-up: one-time costs
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
        torch.cuda.synchronize()
    calls = Counter(e.name for e in prof.events() if e.name.startswith("cuda"))
    per_step = {k: v / args.steps for k, v in sorted(calls.items())
                if k.startswith(SYNCS) or k in ("cudaMalloc", "cudaFree", "cudaMallocAsync")}
    device = torch.cuda.get_device_name(0).replace(" ", "_")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"host_syncs_{device}.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "steps": args.steps, "per_step": per_step}, f, indent=1)
    print(json.dumps(per_step, indent=1))
    gw.shutdown()


if __name__ == "__main__":
    main()
