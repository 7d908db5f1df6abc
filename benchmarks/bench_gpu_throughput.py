"""One GPU: tokens/s and model-FLOPs utilisation of the main job's GPT at a size that fills
the GPU, through gridweave (GPTStage, the pipeline engine, OffloadAdam, bf16) and as plain
torch (the same bf16 model and micro-batches, torch.optim.AdamW), side by side in one run;
gridweave twice, with AdamW on the device and with OffloadAdam, so the offload's price
(optimizer_s) is apart from the engine's. Then float8 against bf16 at a size where the products
dominate (FP8_CFG: hidden 4096): gridweave's linears in fp8 and fp8-rowwise (gw.float8.convert, as
--precision fp8 builds them; torch._scaled_mm, eager) beside the same job in bf16, tokens/s and MFU
against each precision's peak (the goal: 1.3x bf16's tokens/s on an H100).
GPU only (scripts/test_gpu.sh runs it).

    python benchmarks/bench_gpu_throughput.py [--out benchmarks/results/gpu]
"""
from __future__ import annotations

import time

import torch

from launch import bench_parser, results_dir, save

# bf16 dense peak FLOP/s (spec sheets) for the MFU denominator
PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
CFG = dict(vocab=256, hidden=2048, heads=16, layers=16, seq=2048, batch=8, microbatches=2)
FP8_CFG = dict(vocab=256, hidden=4096, heads=32, layers=8, seq=2048, batch=8, microbatches=2)
FP8_PEAK = {"H100": 1979e12, "H200": 1979e12}  # dense float8 tensor cores (spec sheets)
STEPS = 6


def _peak(name: str) -> float:
    return next((v for k, v in PEAK.items() if k in name), float("nan"))


def _flops_per_token(cfg) -> float:
    """AxoNN eq. (3) without recomputation: 72 l h^2 (1 + s/6h + V/16lh) per token (fwd + bwd)."""
    h, s, l, v = cfg["hidden"], cfg["seq"], cfg["layers"], cfg["vocab"]
    return 72 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _batches(cfg, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g, device="cpu").to(device)
    return ids[:, :-1], ids[:, 1:]


def _timed(step, optimizer_step) -> tuple[float, float]:
    """(seconds of the whole step, seconds of its optimizer step), best of STEPS after the first."""
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        optimizer_step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0, time.perf_counter() - t1))
    return min(times[1:])


def plain_torch(cfg, device) -> tuple[float, float]:
    import gridweave as gw

    torch.manual_seed(0)
    model = gw.models.GPT(cfg["vocab"], cfg["hidden"], cfg["heads"], cfg["layers"], cfg["seq"],
                          device=device).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batches(cfg, device)
    mb = cfg["batch"] // cfg["microbatches"]

    def step():
        opt.zero_grad()
        for i in range(cfg["microbatches"]):
            out = model(x[i * mb:(i + 1) * mb])
            (model.loss(out.float(), y[i * mb:(i + 1) * mb]) / cfg["microbatches"]).backward()

    return _timed(step, opt.step)


def gridweave_job(cfg, device, offload: bool, recipe=None) -> tuple[float, float]:
    """offload: AxoNN's OffloadAdam (fp32 master weights and states on the host), else
    torch's AdamW on the device, as plain torch: the difference is the offload's price. recipe:
    the linears' products in float8 (the head's in bf16, as the main job)."""
    import gridweave as gw

    grid = gw.init(device=device)
    torch.manual_seed(0)
    model = gw.models.GPT(cfg["vocab"], cfg["hidden"], cfg["heads"], cfg["layers"], cfg["seq"],
                          device=grid.device).to(torch.bfloat16)
    stage = gw.models.GPTStage(model, grid, None, 0, 1)
    if recipe is not None:
        gw.float8.check_device(grid.device)
        gw.float8.convert(stage, recipe)
    if offload:
        opt = gw.optim.OffloadAdam(stage.parameters(), lr=1e-4, bsize=1 << 24, grid=grid)
    else:
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    x, y = _batches(cfg, grid.device)
    mb = cfg["batch"] // cfg["microbatches"]
    xs = [x[i * mb:(i + 1) * mb] for i in range(cfg["microbatches"])]
    ys = [y[i * mb:(i + 1) * mb] for i in range(cfg["microbatches"])]

    def step():
        opt.zero_grad()
        gw.pipeline.pipeline_step(stage, grid, xs, ys, stage.loss,
                                  stage.activation_shape(mb, cfg["seq"]), dtype=torch.bfloat16)

    out = _timed(step, opt.step)
    gw.shutdown()
    return out


def main() -> None:
    args = bench_parser(__file__).parse_args()
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    flops = _flops_per_token(CFG)
    rows = {}
    jobs = (("plain_torch", lambda: plain_torch(CFG, device)),
            ("gridweave_device_adam", lambda: gridweave_job(CFG, device, offload=False)),
            ("gridweave_offload_adam", lambda: gridweave_job(CFG, device, offload=True)))
    for label, fn in jobs:
        seconds, optimizer_s = fn()
        tok_s = CFG["batch"] * CFG["seq"] / seconds
        rows[label] = {"tokens_per_s": tok_s, "mfu": tok_s * flops / _peak(name), "step_s": seconds,
                       "optimizer_s": optimizer_s, "max_memory_bytes": torch.cuda.max_memory_allocated(device)}
        torch.cuda.reset_peak_memory_stats(device)
        print(label, rows[label], flush=True)
    import gridweave as gw

    fp8_rows, flops8 = {}, _flops_per_token(FP8_CFG)
    for label, recipe in (("bf16", None), ("fp8", gw.float8.Float8Recipe.TENSORWISE),
                          ("fp8_rowwise", gw.float8.Float8Recipe.ROWWISE)):
        try:
            seconds, optimizer_s = gridweave_job(FP8_CFG, device, offload=False, recipe=recipe)
        except Exception as e:  # noqa: BLE001 (a GPU without float8: the row says why)
            fp8_rows[label] = {"error": str(e)}
            continue
        tok_s = FP8_CFG["batch"] * FP8_CFG["seq"] / seconds
        peak = _peak(name) if recipe is None else next((v for k, v in FP8_PEAK.items() if k in name), float("nan"))
        fp8_rows[label] = {"tokens_per_s": tok_s, "mfu": tok_s * flops8 / peak, "step_s": seconds,
                           "optimizer_s": optimizer_s, "max_memory_bytes": torch.cuda.max_memory_allocated(device)}
        torch.cuda.reset_peak_memory_stats(device)
        print("float8", label, fp8_rows[label], flush=True)
    for label in ("fp8", "fp8_rowwise"):
        if "tokens_per_s" in fp8_rows.get(label, {}) and "tokens_per_s" in fp8_rows.get("bf16", {}):
            fp8_rows[label]["speedup_over_bf16"] = fp8_rows[label]["tokens_per_s"] / fp8_rows["bf16"]["tokens_per_s"]
    save(results_dir(args), f"throughput_{name.replace(' ', '_')}", {"device": name, "config": CFG, "rows": rows,
                                                                     "float8_config": FP8_CFG, "float8": fp8_rows})


if __name__ == "__main__":
    main()
