"""`--grid auto`: `gridweave train` runs the planner's fastest grid that fits the world, the model,
the batch and the memory per rank, and says why it ranks above the runner-up."""

import json
import os
import subprocess
import sys

import pytest

from rankpool import launcher_args

JOB = ["--steps", "2", "--hidden", "32", "--layers", "4", "--heads", "4", "--seq", "32", "--batch", "8",
       "--microbatches", "2", "--tokenizer", "bytes", "--val-every", "0", "--sample-tokens", "0", "--device", "cpu"]
MODELS = {"llama": [], "gpt": ["--model", "gpt"], "mixtral": ["--model", "mixtral", "--experts", "4"]}


def _train(out, *args, port):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    env.pop("GRIDWEAVE_GRID", None)
    return subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *JOB, "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("model,port", [("llama", 29861), ("gpt", 29863), ("mixtral", 29865)])
def test_grid_auto_trains_on_the_planners_first_row(tmp_path, model, port):
    """The chosen grid (printed, run and recorded in metrics.json) is the first row of the planner
    asked here for the same job on 2 ranks of this machine's preset; the job trains on it."""
    from gridweave import autogrid, plan
    from gridweave.config import TrainConfig

    r = _train(tmp_path / model, "--grid", "auto", "--nproc", "2", *MODELS[model], *launcher_args(), port=port)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    given = dict(model=model, hidden=32, layers=4, heads=4, seq=32, batch=8, microbatches=2, tokenizer="bytes",
                 **({"experts": 4} if model == "mixtral" else {}))
    cfg = TrainConfig(**given)
    rows = plan.plan(2, plan.model_of(cfg), plan.load_cluster("local", 2), microbatches=2, workers=1,
                     recompute=False, **cfg.planned_optimizer())
    first = rows[0]
    assert first["fits"]
    want = autogrid.plan_shape(first)
    assert f"grid auto: {want.spec()}" in r.stdout, r.stdout[-3000:]
    assert "ranks above the runner-up" in r.stdout or "the only grid" in r.stdout
    metrics = json.loads((tmp_path / model / "metrics.json").read_text())
    ran = plan.GridShape.parse(metrics["grid_shape"])
    assert metrics["grid_policy"] == "auto"
    for k in ("dp", "pp", "tp", "sp", "zero", "placement", "chunks", "ep"):
        assert getattr(ran, k) == getattr(want, k), (k, metrics["grid_shape"], want.spec())
    if want.schedule != "auto":
        assert ran.schedule == want.schedule
    losses = metrics["loss"]
    assert len(losses) == 2 and all(x == x and 0 < x < 20 for x in losses)


def test_grid_auto_refuses_given_degrees_and_a_world_nothing_fits(tmp_path):
    """grid auto with a degree given, or on a machine whose ranks hold too little memory for any
    grid: one clear line, before any rank starts."""
    from gridweave import plan
    r = _train(tmp_path / "a", "--grid", "auto", "--dp", "2", "--nproc", "4", port=29867)
    assert r.returncode == 2 and "grid auto chooses" in r.stderr and "leave out dp" in r.stderr, r.stderr[-2000:]
    tiny = tmp_path / "tiny.json"
    preset = json.loads((plan.PRESETS / "local.json").read_text())
    tiny.write_text(json.dumps(dict(preset, name="tiny", memory_bytes=1024)))
    r = _train(tmp_path / "b", "--grid", "auto", "--cluster", str(tiny), "--nproc", "4", port=29869)
    assert r.returncode == 2 and "no grid of 4 ranks fits a rank's memory on tiny" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())


def test_grid_auto_under_the_users_own_torchrun_is_rank_0s_plan(tmp_path):
    """Ranks started by torchrun itself (no gridweave launcher planned for them): rank 0 plans, the
    others take its choice from the rendezvous store, and they train on the planner's first row."""
    from gridweave import autogrid, launch, plan
    from gridweave.config import TrainConfig

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GRIDWEAVE_GRID", None)
    r = subprocess.run([*launch.torchrun_command(2, 29871), "-m", "gridweave.cli", "train", *JOB,
                        "--grid", "auto", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = TrainConfig(hidden=32, layers=4, heads=4, seq=32, batch=8, microbatches=2, tokenizer="bytes")
    rows = plan.plan(2, plan.model_of(cfg), plan.load_cluster("local", 2), microbatches=2, workers=1,
                     recompute=False, **cfg.planned_optimizer())
    want = autogrid.plan_shape(rows[0])
    ran = plan.GridShape.parse(json.loads((out / "metrics.json").read_text())["grid_shape"])
    assert (ran.dp, ran.pp, ran.tp, ran.sp, ran.zero) == (want.dp, want.pp, want.tp, want.sp, want.zero), \
        (ran.spec(), want.spec())


def test_verify_checks_the_grid_auto_would_choose(tmp_path):
    """`gridweave verify --grid auto` verifies the grid the job would run on (the planner's first row
    for its world), not the default degrees."""
    from gridweave import autogrid, plan
    from gridweave.config import TrainConfig

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29873"}
    env.pop("GRIDWEAVE_GRID", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", "--nproc", "4", "--grid", "auto", *JOB[2:]],
                       capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert r.returncode == 0 and "verify: ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = TrainConfig(hidden=32, layers=4, heads=4, seq=32, batch=8, microbatches=2, tokenizer="bytes")
    rows = plan.plan(4, plan.model_of(cfg), plan.load_cluster("local", 4), microbatches=2, workers=1,
                     recompute=False, **cfg.planned_optimizer())
    want = autogrid.plan_shape(rows[0])
    said = "dp " + str(want.dp) + (f" x pp {want.pp}" if want.pp > 1 else "")
    assert f"the job on 4 ranks as llama on {said}" in r.stdout, (want.spec(), r.stdout[-2000:])
