"""gw.plan's measured costs (issue 34): all-reduces over lines of a calibrated size cost what
calibrate.all_reduce_lines timed of them, whole; collective_s is charged to the other
collectives only, and fitted over those; a step's own fixed cost, once a step; a micro-batch's,
once a micro-batch on every stage."""
import dataclasses
import json

import numpy as np
import pytest

import gridweave as gw
from gridweave import calibrate, plan
from gridweave.measure import relative_fit
from gridweave.models import ModelConfig

ROW = (2, 1e-3, 1e-9)  # a 2-member line: 1 ms an all-reduce, plus 1 ns a byte of its buffer


def _layers(layers=3, hidden=64, seq=32, batch=8):
    """The layer stack alone (no embedding, head, loss or optimizer), float32."""
    return plan.Model(ModelConfig("gpt", 512, hidden=hidden, heads=4, layers=layers, seq=seq), batch=batch,
                      bytes_per_value=4, embedding=False)


def test_an_all_reduce_over_a_measured_line_size_costs_its_row():
    """Row:2 (Megatron-LM §3): f's backward and g's forward in each of a layer's two blocks, four
    all-reduces of the micro-batch's activations over the 2-member tp line a layer and micro-batch;
    each costs the row's seconds plus its bytes at the row's rate, nothing else (no alpha, no
    collective_s, no launch: the row timed the whole call)."""
    base = plan.load_cluster("a100-ib")  # 8 GPUs a node: every tp line inside one
    model, grid, m = _layers(), plan.GridShape(dp=4, tp=gw.Row(2)), 2
    nbytes = (8 // 4 // m) * 32 * 64 * 4  # a micro-batch's activations on this replica, float32
    expected = 3 * 4 * m * (ROW[1] + ROW[2] * nbytes)
    for cluster in (dataclasses.replace(base, all_reduce_s=(ROW,)),
                    dataclasses.replace(base, all_reduce_s=(ROW,), collective_s=1.0, launch_s=1.0)):
        r = plan.predict(model, grid, cluster, microbatches=m)
        assert r["seconds_per_axis"]["tp"] == pytest.approx(expected, rel=1e-12)
    # a row for another line size leaves the 2-member lines to alpha-beta, as without one
    other, none = (plan.predict(model, grid, dataclasses.replace(base, all_reduce_s=rows), microbatches=m)
                   for rows in (((4, 5.0, 1.0),), ()))
    assert other["seconds_per_axis"] == none["seconds_per_axis"] and other["step_time_s"] == none["step_time_s"]
    link = plan._links(grid, base)[0]["tp"]
    assert none["seconds_per_axis"]["tp"] == pytest.approx(
        3 * 4 * m * (base.launch_s + base.collective_s + plan.collective_time("all_reduce", 2, nbytes, link[:2], base)),
        rel=1e-12)


def test_a_measured_row_is_for_lines_inside_a_node():
    """The rows were timed inside a node: an all-reduce over a line that leaves it is alpha-beta
    over the network link, whatever the rows say."""
    model = plan.Model(ModelConfig("gpt", 512, hidden=64, heads=4, layers=2, seq=32), batch=8)
    grid = plan.GridShape(dp=4, tp=gw.Row(2))
    base = dataclasses.replace(plan.load_cluster("a100-ib"), gpus_per_node=2)  # tp inside a node, dp across
    rows = ((2, 0.5, 0.0), (4, 7.0, 1.0))
    r, alpha_beta = (plan.predict(model, grid, dataclasses.replace(base, all_reduce_s=a)) for a in (rows, ()))
    assert r["axis_links"]["dp"].startswith("inter") and r["axis_links"]["tp"] == "intra"
    assert r["seconds_per_axis"]["dp"] == alpha_beta["seconds_per_axis"]["dp"]
    assert r["seconds_per_axis"]["tp"] != alpha_beta["seconds_per_axis"]["tp"]


@pytest.mark.parametrize("grid", [plan.GridShape(dp=8), plan.GridShape(dp=2, tp=gw.Row(2), sp=2),
                                  plan.GridShape(dp=2, tp=gw.Square(2))])
def test_collective_s_is_charged_to_the_counted_collectives_alone(grid):
    """fixed_cost_collectives is what calibrate fits collective_s over: a second more of it adds
    exactly that many seconds to the step. With every line's all-reduces measured (and the
    one-element ones), a data-parallel step has none left."""
    model = plan.Model(ModelConfig("llama", 256, hidden=64, heads=4, layers=2, seq=32), batch=8, bytes_per_value=4)
    cluster = dataclasses.replace(plan.load_cluster("a100-ib"), scalar_all_reduce_s=1e-4,
                                  all_reduce_s=((2, 1e-3, 1e-9), (4, 2e-3, 1e-9), (8, 4e-3, 1e-9)))
    cheap, costly = (plan.predict(model, grid, dataclasses.replace(cluster, collective_s=c)) for c in (0.0, 1.0))
    assert costly["fixed_cost_collectives"] == cheap["fixed_cost_collectives"]
    assert costly["step_time_s"] - cheap["step_time_s"] == pytest.approx(cheap["fixed_cost_collectives"], rel=1e-9)
    assert 0 <= cheap["fixed_cost_collectives"] <= cheap["collectives"]
    if grid.tp.spec() == "none":
        assert cheap["fixed_cost_collectives"] == 0 < cheap["collectives"]


def test_a_steps_own_cost_is_paid_once_a_step():
    model, grid = _layers(layers=4), plan.GridShape(dp=2, pp=2)
    base = plan.load_cluster("a100-ib")
    a, b = (plan.predict(model, grid, dataclasses.replace(base, step_s=s), microbatches=4) for s in (0.0, 0.25))
    assert b["step_time_s"] - a["step_time_s"] == pytest.approx(0.25, rel=1e-9)
    t = b["time_breakdown_s"]
    assert t["compute"] - a["time_breakdown_s"]["compute"] == pytest.approx(0.25, rel=1e-9)
    assert t["compute"] + t["recompute"] + t["bubble"] + sum(t["communication"].values()) == \
        pytest.approx(b["step_time_s"], rel=1e-12)


def test_a_micro_batchs_own_cost_is_paid_once_a_micro_batch_on_every_stage():
    model, base = _layers(layers=4), plan.load_cluster("a100-ib")
    for grid, m in ((plan.GridShape(dp=2), 4), (plan.GridShape(dp=4, tp=gw.Row(2)), 2)):
        a, b = (plan.predict(model, grid, dataclasses.replace(base, microbatch_s=s), microbatches=m) for s in (0.0, 0.25))
        assert b["step_time_s"] - a["step_time_s"] == pytest.approx(0.25 * m, rel=1e-9)
        assert b["time_breakdown_s"]["compute"] - a["time_breakdown_s"]["compute"] == pytest.approx(0.25 * m, rel=1e-9)
    # a pipeline: every stage pays it each micro-batch, so the 1F1B step (m + p - 1 slots) grows by that many
    a, b = (plan.predict(model, plan.GridShape(dp=1, pp=2), dataclasses.replace(base, microbatch_s=s), microbatches=4)
            for s in (0.0, 0.25))
    assert b["step_time_s"] - a["step_time_s"] == pytest.approx(0.25 * (4 + 2 - 1), rel=1e-9)


def _tiny(family, microbatches=1):
    return gw.train.TrainConfig(model=family, hidden=32, heads=4, layers=2, seq=16, batch=8, microbatches=microbatches,
                                tokenizer="bytes", dp=1, pp=1)


def _ops_a_step(ctx, family, microbatches):
    """The kernels (every op but views) of one gw.train step on one rank, counted as they run."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    cfg = _tiny(family, microbatches)
    grid = ctx.init(dp=1)
    torch.manual_seed(0)
    _, stage, opt, scaler = gw.train.build(cfg, grid, cfg.model_config(256))
    x = torch.randint(0, 256, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0), device="cpu")
    gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
    count = Count()
    with count:
        gw.train.train_step(cfg, grid, stage, opt, scaler, x, x.roll(1, 1))
    return dict(count.ops)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_the_kernels_a_further_micro_batch_issues_are_the_ones_a_step_runs(pool, family):
    """Each micro-batch after the first adds its gradients into the held ones (one add_ a parameter
    tensor): the planner's kernels per further micro-batch are what a real step runs, counted op by op."""
    (one,), (four,) = (pool.run(_ops_a_step, 1, family, m, timeout=120) for m in (1, 4))
    ran = (sum(four.values()) - sum(one.values())) / 3
    model = plan.model_of(_tiny(family))
    c = plan.load_cluster("a100-ib")
    k1, k4 = (plan.predict(model, plan.GridShape(dp=1), c, microbatches=m)["kernels"] for m in (1, 4))
    assert (four.get("add_", 0) - one.get("add_", 0)) / 3 >= 10  # the accumulations, one a parameter tensor
    assert (k4 - k1) / 3 == pytest.approx(ran, rel=0.05)


def test_a_presets_rows_load_from_json_and_key_the_lines_cache(tmp_path):
    preset = json.loads(plan.PRESETS.joinpath("a100-ib.json").read_text())
    preset["all_reduce_s"] = [list(ROW), [4, 2e-3, 2e-9]]
    path = tmp_path / "local.json"
    path.write_text(json.dumps(preset))
    c = plan.load_cluster(str(path))
    assert c.all_reduce_s == (ROW, (4, 2e-3, 2e-9)) and hash(c) == hash(dataclasses.replace(c))
    assert c.measured_all_reduce(4, 1000) == pytest.approx(2e-3 + 2e-6) and c.measured_all_reduce(8, 1) is None
    assert plan.predict(_layers(), plan.GridShape(dp=4, tp=gw.Row(2)), c, microbatches=2)["step_time_s"] > 0


def test_the_all_reduce_rows_are_relative_least_squares_fits():
    """calibrate.fit_all_reduce: per line size, seconds = fixed + bytes x per byte, each error
    relative to its time: exact on exact times, and against numpy's least squares on noisy ones."""
    sizes = calibrate.ALL_REDUCE_SIZES
    exact = {2: {n: 2e-3 + 1.5e-9 * n for n in sizes}, 8: {n: 9e-3 + 2e-9 * n for n in sizes}}
    assert [tuple(pytest.approx(v, rel=1e-9) for v in row) for row in calibrate.fit_all_reduce(exact)] == \
        [(2, 2e-3, 1.5e-9), (8, 9e-3, 2e-9)]
    as_saved = json.loads(json.dumps(exact))  # a preset's measured_all_reduce_s, keys as strings
    assert calibrate.fit_all_reduce(as_saved) == calibrate.fit_all_reduce(exact)
    rng = np.random.default_rng(0)
    noisy = {4: {n: (4e-3 + 1.8e-9 * n) * (1 + 0.1 * rng.standard_normal()) for n in sizes}}
    ((g, fixed, per_byte),) = calibrate.fit_all_reduce(noisy)
    t = np.array(list(noisy[4].values()))
    a = np.stack([np.ones(len(sizes)), np.array(sizes, dtype=float)], 1) / t[:, None]
    (want_fixed, want_per_byte), *_ = np.linalg.lstsq(a, np.ones(len(sizes)), rcond=None)
    assert g == 4 and fixed == pytest.approx(want_fixed, rel=1e-9) and per_byte == pytest.approx(want_per_byte, rel=1e-9)


def test_a_residual_is_fitted_relative_to_the_time_it_is_part_of():
    """relative_fit(..., relative_to): the fixed costs' fit, each residual's error over its step's
    time (a residual may be near 0 or below); a cost the residuals cannot carry (< 0) is left out."""
    steps = np.array([0.02, 0.05, 0.06, 0.2])
    counts = np.array([0.0, 0.0, 10.0, 100.0])
    unexplained = 0.007 + counts * 8e-4
    assert relative_fit([[1.0] * 4, counts], unexplained, steps) == [pytest.approx(0.007), pytest.approx(8e-4)]
    noisy = unexplained + np.array([0.002, -0.003, 0.001, 0.004])
    a = np.stack([np.ones(4), counts], 1) / steps[:, None]
    want, *_ = np.linalg.lstsq(a, noisy / steps, rcond=None)
    assert relative_fit([[1.0] * 4, counts], noisy, steps) == [pytest.approx(w, rel=1e-9) for w in want]
    # no per-step cost to see: the fit leaves it out and refits the slope alone, through zero
    falling = counts * 8e-4 - 0.01
    slope = float(((counts / steps) @ (falling / steps)) / ((counts / steps) @ (counts / steps)))
    assert relative_fit([[1.0] * 4, counts], falling, steps) == [0.0, pytest.approx(slope, rel=1e-9)]


def test_a_measured_all_reduce_amid_a_step_costs_its_row_and_measured_call_s():
    """measured_call_s: each all-reduce a row measured whole costs that much more inside a step
    (Megatron-LM §3's four all-reduces a layer over the tp line); the one-element all-reduces over
    every rank (timed as a step issues them) and the collectives costed alpha-beta do not."""
    model, grid, m = _layers(), plan.GridShape(dp=4, tp=gw.Row(2)), 2
    nbytes = (8 // 4 // m) * 32 * 64 * 4
    base = dataclasses.replace(plan.load_cluster("a100-ib"), all_reduce_s=(ROW,))
    for call_s in (0.0, 1e-3, 0.25):
        r = plan.predict(model, grid, dataclasses.replace(base, measured_call_s=call_s), microbatches=m)
        assert r["seconds_per_axis"]["tp"] == pytest.approx(3 * 4 * m * (ROW[1] + ROW[2] * nbytes + call_s), rel=1e-12)
        assert r["measured_collectives"] == 3 * 4 * m and r["fixed_cost_collectives"] == 0
    # the whole job: the loss's and the norm's scalars are not charged, nor the alpha-beta collectives
    full = plan.Model(ModelConfig("llama", 256, hidden=64, heads=4, layers=2, seq=32), batch=8, bytes_per_value=4)
    cluster = dataclasses.replace(base, scalar_all_reduce_s=1e-4)
    for g in (plan.GridShape(dp=8), plan.GridShape(dp=2, tp=gw.Row(2), sp=2), plan.GridShape(dp=2, tp=gw.Square(2))):
        cheap, costly = (plan.predict(full, g, dataclasses.replace(cluster, measured_call_s=c)) for c in (0.0, 1.0))
        assert costly["step_time_s"] - cheap["step_time_s"] == pytest.approx(cheap["measured_collectives"], rel=1e-9)
        assert cheap["measured_collectives"] + cheap["fixed_cost_collectives"] <= cheap["collectives"]


def test_compute_scale_multiplies_the_kernels_of_the_busy_share_of_a_step():
    """compute_scale: a step's kernels take that many times their probes' seconds, over the share
    of the step its ranks compute: all of it without a pipeline; 1 / (1 + (p - 1) / m) with one
    (Megatron-LM §2.2's 1F1B bubble (p - 1) / m), the busy ranks' contention. Communication is
    not scaled."""
    base = plan.load_cluster("a100-ib")
    for grid, m in ((plan.GridShape(dp=4, tp=gw.Row(2)), 2), (plan.GridShape(dp=2, pp=2), 4),
                    (plan.GridShape(dp=1, pp=4, sp=2), 2)):
        busy = 1 / (1 + (grid.pp - 1) / m)
        one, scaled = (plan.predict(_layers(layers=4), grid, dataclasses.replace(base, compute_scale=k), microbatches=m)
                       for k in (1.0, 1.5))
        a, b = one["time_breakdown_s"], scaled["time_breakdown_s"]
        assert b["compute"] == pytest.approx(a["compute"] * (1 + 0.5 * busy), rel=1e-12)
        assert b["communication"] == pytest.approx(a["communication"], rel=1e-12)


def test_the_fixed_costs_fit_recovers_the_terms_of_steps_they_made():
    """calibrate.fit_fixed_costs on steps whose times are the planner's own under known terms
    (every grid calibrate times, the main job's shape among them) gives those terms back."""
    preset = json.loads(plan.PRESETS.joinpath("a100-ib.json").read_text())
    preset.update(ranks=8, gpus_per_node=8, cores_per_node=2, scalar_all_reduce_s=5e-4,
                  all_reduce_s=[[2, 2e-3, 1e-9], [4, 4e-3, 2e-9], [8, 9e-3, 2e-9]])
    true = dict(step_s=7e-3, microbatch_s=2e-3, collective_s=6e-4, measured_call_s=3e-4, compute_scale=1.3)
    rows = []
    for what, extra in calibrate._fixed_cost_configs():
        row = dict(model=what, grid=extra)
        row["measured_s"] = calibrate._predicted(preset, row, **true)["step_time_s"]
        rows.append(row)
    assert {r["model"] for r in rows} == {"small", "main"}
    fitted = calibrate.fit_fixed_costs(preset, rows)
    assert fitted == {k: pytest.approx(v, rel=1e-6) for k, v in true.items()}
    assert all(abs(r["unexplained_s"]) < 1e-9 for r in rows)


def test_calibrations_combine_into_their_probes_medians_and_a_refit_of_their_steps():
    """calibrate.combine: every probe the median over the calibrations (two: their mean; lists
    element-wise), each timed step the median of its times, and the fitted terms those of
    fit_fixed_costs on them: steps made by the planner under known terms at the probes' medians
    give the terms back, whatever each calibration alone would have fitted."""
    base = json.loads(plan.PRESETS.joinpath("a100-ib.json").read_text())
    base.update(ranks=8, gpus_per_node=8, cores_per_node=2, scalar_all_reduce_s=5e-4,
                all_reduce_s=[[2, 2e-3, 1e-9], [4, 4e-3, 2e-9], [8, 9e-3, 2e-9]],
                busy_speedup=[4.0, 3.0, 2.0, 1.0], softmax_by_size=[[1 << 16, 4e-9], [1 << 22, 1e-7]])
    true = dict(step_s=7e-3, microbatch_s=2e-3, collective_s=6e-4, measured_call_s=3e-4, compute_scale=1.3)
    scales = (0.8, 1.0, 1.5)  # three calibrations: the probes' rates and the steps' times apart
    presets = []
    for k, f in enumerate(scales):
        p = json.loads(json.dumps(base))
        p["gemm_flops"] = base["gemm_flops"] * f
        p["busy_speedup"] = [x * f for x in base["busy_speedup"]]
        p["softmax_by_size"] = [[n, t * f] for n, t in base["softmax_by_size"]]
        p.update({t: v * (1 + k) for t, v in true.items()})  # each its own fit, all of them discarded
        p["fixed_cost_steps"] = []
        presets.append(p)
    median = dict(base)  # the probes' medians: scale 1.0
    for what, extra in calibrate._fixed_cost_configs():
        want = calibrate._predicted(median, dict(model=what, grid=extra), **true)["step_time_s"]
        for p, f in zip(presets, (0.9, 1.0, 1.2)):  # the middle one is each step's median
            p["fixed_cost_steps"].append(dict(model=what, grid=extra, measured_s=want * f, unexplained_s=0.0))
    c = calibrate.combine(presets[::-1])
    assert c["gemm_flops"] == pytest.approx(base["gemm_flops"], rel=1e-12)
    assert c["busy_speedup"] == pytest.approx(base["busy_speedup"], rel=1e-12)
    assert c["softmax_by_size"] == [[n, pytest.approx(t, rel=1e-12)] for n, t in base["softmax_by_size"]]
    assert {k: c[k] for k in true} == {k: pytest.approx(v, rel=1e-6) for k, v in true.items()}
    assert all(abs(r["unexplained_s"]) < 1e-9 for r in c["fixed_cost_steps"])
    assert len(c["fixed_cost_steps"]) == len(calibrate._fixed_cost_configs())
    two = calibrate.combine(presets[:2])  # two: their mean
    assert two["gemm_flops"] == pytest.approx(base["gemm_flops"] * 0.9, rel=1e-12)
    assert plan.Cluster.of(c).softmax_at(1 << 19) == pytest.approx((4e-9 + 1e-7) / 2, rel=1e-12)
    unfitted = [{k: v for k, v in p.items() if k != "fixed_cost_steps"} for p in presets]
    assert calibrate.combine(unfitted)["collective_s"] == pytest.approx(2 * true["collective_s"], rel=1e-12)
    with pytest.raises(gw.GridError, match="no presets"):
        calibrate.combine([])
