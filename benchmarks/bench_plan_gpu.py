"""gw.plan on one GPU (issue 18): calibrate on the GPU, then predict and measure a training
step of the main job's model (gridweave train's defaults, fp32) and of a wider one in bf16
that keeps the GPU busy, the optimizer where gridweave train puts it (offload=auto: the device
here), and the wide one again with its state in host memory: the step time (median of the timed
steps) and the device memory (max_memory_allocated over a step, over what was allocated before
the model, cuBLAS's workspace made first). GPU only (scripts/test_gpu.sh runs it).

    python benchmarks/bench_plan_gpu.py [--out benchmarks/results/gpu]
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from launch import bench_parser, results_dir, save

STEPS, WARMUP = 5, 2
WIDE = dict(hidden=1024, heads=16, layers=8, seq=1024, batch=16, precision="bf16")
JOBS = {"main_job": {}, "wide_bf16": WIDE,
        # a third shape: deep and narrow in bf16 (many small kernels: the launch term's share)
        "deep_bf16": dict(hidden=512, heads=8, layers=24, seq=512, batch=16, precision="bf16"),
        # the wide one with its optimizer state in host memory (what offload=auto picks where the
        # state does not fit): OffloadAdam's device buckets, their kernels and their host link
        "wide_bf16_offload": dict(WIDE, offload=True)}


def measure(grid, cfg) -> dict:
    import gridweave as gw

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(cfg.seed)
    stage, opt, scaler = gw.train.build(cfg, grid, cfg.model_config(cfg.vocab))[1:]
    x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    out = {"measured_s": statistics.median(times), "measured_bytes": torch.cuda.max_memory_allocated() - base}
    del stage, opt, scaler
    torch.cuda.empty_cache()
    return out


def main() -> None:
    import gridweave as gw
    from gridweave import calibrate, plan

    args = bench_parser(__file__).parse_args()
    grid = gw.init(backend="gloo", device="cuda")
    calibrate.make_cublas_workspaces(grid.device)
    presets = {}  # one calibration per compute dtype: the planner has one GEMM rate
    rows = {}
    for name, sizes in JOBS.items():
        cfg = gw.train.TrainConfig(device="cuda", **sizes)
        cfg = dataclasses.replace(cfg, offload=gw.train.resolve_offload(cfg, grid))  # as gw.train decides it
        dtype = cfg.compute.dtype
        if dtype not in presets:
            presets[dtype] = calibrate.measure(grid, dtype=dtype)
        preset = presets[dtype]
        cluster = plan.Cluster.of(preset)
        p = plan.predict(plan.model_of(cfg), plan.GridShape(), cluster, microbatches=cfg.microbatches,
                         **cfg.planned_optimizer())
        row = {**measure(grid, cfg), "predicted_s": p["step_time_s"], "predicted_bytes": p["memory_bytes"],
               "time_breakdown_s": p["time_breakdown_s"], "memory_breakdown_bytes": p["memory_breakdown_bytes"]}
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
        row["memory_error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
        rows[name] = row
        print(name, {k: row[k] for k in ("measured_s", "predicted_s", "error", "measured_bytes", "predicted_bytes",
                                         "memory_error")}, flush=True)
    gw.shutdown()
    device = torch.cuda.get_device_name(0)
    save(results_dir(args), f"plan_gpu_{device.replace(' ', '_')}",
         {"device": device, "presets": {str(d).removeprefix("torch."): p for d, p in presets.items()}, "rows": rows})


if __name__ == "__main__":
    main()
