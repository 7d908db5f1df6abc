"""Mixed precision (AxoNN §V): bf16, and fp16 with dynamic loss scaling; fp32 master
weights; an overflow anywhere skips that step on every rank and halves the scale."""
import json
import os
import subprocess
import sys

import pytest
import torch

V, H, HEADS, SEQ, BATCH = 32, 16, 2, 8, 8


def test_loss_scaler_backs_off_and_grows():
    import gridweave as gw

    s = gw.precision.LossScaler(init_scale=1024.0, growth_interval=3, min_scale=256.0, device="cpu")
    assert s.update(False) and s.update(False) and s.scale_value == 1024.0
    assert s.update(torch.tensor(0.0, device="cpu")) and s.scale_value == 2048.0  # 3 clean steps: doubled
    assert not s.update(torch.tensor(True, device="cpu")) and s.scale_value == 1024.0  # overflow: skipped, halved
    assert s.clean_steps == 0 and s.last_used.item() == 2048.0      # the step ran with 2048
    for _ in range(3):
        s.update(True)
    assert s.scale_value == 256.0                                   # not below min_scale
    assert s.tensor.device.type == "cpu" and s.tensor.dtype == torch.float32  # on the device, unread
    t = gw.precision.LossScaler(init_scale=8.0)
    t.load_state_dict(s.state_dict())                               # before it has a device
    assert t.scale(torch.ones((), device="cpu")).item() == 256.0 and t.clean_steps == 0
    t.load_state_dict({"scale": 256.0, "clean_steps": 4500})  # an older state: clean steps since the last skip
    assert t.clean_steps == 500  # since the last growth (growth_interval 2000), so it grows again
    with pytest.raises(gw.GridError):
        gw.precision.LossScaler(backoff_factor=2.0)
    with pytest.raises(gw.GridError, match="precision must be one of"):
        gw.precision.Precision.parse("fp4")


def _overflow(ctx, bad_rank, bad_step, steps=5):
    import gridweave as gw

    grid = ctx.init(dp=ctx.world_size)
    torch.manual_seed(0)
    model = gw.models.GPT(V, H, HEADS, 2, SEQ, device="cpu").to(torch.float16)
    opt = gw.optim.OffloadAdam(model.parameters(), lr=1e-2, bsize=64, grid=grid)
    scaler = gw.precision.LossScaler(init_scale=2.0 ** 10)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g, device="cpu")
    shard = BATCH // ctx.world_size
    x, y = ids[ctx.rank * shard:(ctx.rank + 1) * shard, :-1], ids[ctx.rank * shard:(ctx.rank + 1) * shard, 1:]
    scales, taken, frozen = [], [], None
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model.loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == bad_step and ctx.rank == bad_rank:
            next(model.parameters()).grad[0, 0] = float("inf")  # one element on one rank overflows
        before = [p.detach().clone() for p in model.parameters()]
        scales.append(scaler.scale_value)
        taken.append(bool(opt.step(scaler)))  # decided on the device; read here, by the test
        if step == bad_step:
            frozen = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters()) and \
        bool(torch.isfinite(opt.master).all() and torch.isfinite(opt.exp_avg_sq).all())
    skipped = [s for s, took in enumerate(taken, 1) if not took]
    return taken, scales, skipped, frozen, finite, opt.step_count


def test_an_overflow_on_one_rank_skips_that_step_everywhere(pool):
    for taken, scales, skipped, frozen, finite, count in pool.run(_overflow, 4, 2, 3):
        assert taken == [True, True, False, True, True]   # exactly step 3, on every rank
        assert skipped == [3] and frozen and finite
        assert scales[3] == scales[2] / 2                  # halved for the step after
        assert count == 4                                  # the skipped step did not count


# ---- the main job in bf16 and fp16 against the fp32 one-process run ------------------------

ARGS = ["--steps", "20", "--hidden", "32", "--layers", "4", "--heads", "4", "--seq", "32", "--batch", "8",
        "--tokenizer", "bytes", "--warmup", "2", "--val-every", "0", "--sample-tokens", "0", "--quiet"]
# bf16 keeps 8 mantissa bits, fp16 11: over 20 steps the losses stay within these of fp32's
# (measured here: at most 5.5e-4 for bf16 and 4.9e-5 for fp16 on these three grids)
TOLERANCE = {"bf16": 2e-3, "fp16": 4e-4}


def _train(tmp, name, *extra, port, args=ARGS):
    """The losses of `gridweave train` with `args` and `extra` (metrics.json's), in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    out = tmp / name
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *args, "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    if "--host-reads" in extra:
        from test_train import _one_host_read_a_step
        _one_host_read_a_step(out)  # fp16: the loss scaler's decisions were the device's
    return json.loads((out / "metrics.json").read_text())["loss"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("fp32"), "one", "--nproc", "1", port=29701)


# each precision on two of the three grids, each grid in both (the six pairs cost a CI run 4 minutes)
@pytest.mark.parametrize("precision,spec,port", [
    ("bf16", ["--tp", "cube:2"], 29703), ("fp16", ["--tp", "cube:2"], 29704),
    ("bf16", ["--tp", "row:2", "--sp", "2", "--pp", "2"], 29705),
    ("fp16", ["--tp", "subgraph:2", "--dp", "2", "--pp", "2"], 29707)])
def test_half_precision_tracks_fp32(fp32, tmp_path, precision, spec, port):
    losses = _train(tmp_path, precision, "--nproc", "8", "--precision", precision, "--host-reads", *spec, port=port)
    assert all(torch.isfinite(torch.tensor(losses, device="cpu")))
    assert fp32[-1] < fp32[0] - 0.3 and losses[-1] < losses[0] - 0.3   # both learn
    worst = max(abs(a - b) / b for a, b in zip(losses, fp32))
    assert worst < TOLERANCE[precision], (precision, spec, worst, losses, fp32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without a GPU")
def test_asking_for_a_gpu_where_none_is_visible_is_one_clear_error(tmp_path):
    import gridweave as gw

    for kw in ({"device": "cuda"}, {"backend": "nccl"}, {"device": "cuda:1"}):
        with pytest.raises(gw.GridError, match="no CUDA GPU|without the NCCL transport"):
            gw.init(**kw)
    with pytest.raises(gw.GridError, match="computes on GPUs|no CUDA GPU|without the NCCL"):
        gw.init(backend="nccl", device="cpu")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, "--nproc", "1", "--device", "cuda",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "--device cuda was asked for but this process sees no CUDA GPU" in r.stderr
    assert not (tmp_path / "x").exists()  # nothing written
