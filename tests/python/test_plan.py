"""gw.plan: the alpha-beta costs, the papers' formulas it is built on, the placement-aware
links, and the `gridweave plan` command."""
import json
import subprocess
import sys

import pytest

import gridweave as gw
from gridweave import plan


def test_ring_costs_are_alpha_beta():
    link = (1e-5, 1e9)
    g, n = 8, 8e6
    assert plan.collective_time("all_reduce", g, n, link, None) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * n / 1e9)
    assert plan.collective_time("all_gather", g, n, link, None) == pytest.approx(7 * 1e-5 + 7 / 8 * n / 1e9)
    assert plan.collective_time("all_reduce", g, n, link, None, "halving_doubling") == \
        pytest.approx(2 * 3 * 1e-5 + 2 * 7 / 8 * n / 1e9)
    assert plan.collective_time("broadcast", 1, n, link, None) == 0


def test_papers_formulas():
    assert plan.bubble_fraction(4, 8) == 3 / 8  # (p-1)/m
    m = plan.Model(hidden=8192, layers=24, heads=64, seq=512, batch=384, vocab=51200)
    b, s, l, h, v = 384, 512, 24, 8192, 51200
    assert plan.transformer_flops(m, recompute=True) == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h)
                                                                                               + v / (16 * l * h)))


def test_topology_keeps_subgraph_lines_inside_a_node():
    cluster = plan.load_cluster("v100-ib")  # 4 GPUs per node
    for placement, where in (("topology", "intra"), ("naive", "inter")):
        g = plan.Grid(dp=4, tp="subgraph", tp_size=4, placement=placement)
        links, placement_obj = plan._links(g, cluster)
        assert (links["sg"][2] == 1) == (where == "intra")
        # and the engine's SUPER model agrees: eq. (7) 0 inter-node messages with topology
        t = placement_obj.traffic(["sg"], "all_to_all", 1024)
        assert (t["inter_messages"] == 0) == (where == "intra")


def test_memory_follows_axonn_accounting():
    cluster = plan.load_cluster("a100-ib")
    m = plan.Model(hidden=1024, layers=8, heads=16, seq=256, batch=32)
    full = plan.predict(m, plan.Grid(dp=8), cluster)
    off = plan.predict(m, plan.Grid(dp=8), cluster, offload_bsize=1 << 20)
    phi = 12 * 8 * 1024 * 1024 + 51200 * 1024
    assert full["memory_bytes"] - off["memory_bytes"] == pytest.approx(20 * phi - (4 * phi + 16 * (1 << 20)))


def test_plan_command_json(tmp_path):
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"name": "mine", "gpus_per_node": 2, "intra_alpha_s": 1e-5,
                                  "intra_bandwidth_Bps": 1e10, "inter_alpha_s": 1e-4, "inter_bandwidth_Bps": 1e9,
                                  "gemm_flops": 1e12, "memory_bytes": 1 << 34}))
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "plan", "--gpus", "8", "--cluster", str(preset),
                        "--hidden", "256", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "16",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows and all({"dp", "pp", "tp", "sp", "placement", "step_time_s", "memory_bytes"} <= set(x) for x in rows)
    times = [x["step_time_s"] for x in rows if x["memory_bytes"] <= 1 << 34]
    assert times == sorted(times)
    for x in rows:
        tp_ranks = {"none": 1}.get(x["tp"]) or _tp_ranks(x["tp"])
        assert x["dp"] * x["pp"] * x["sp"] * tp_ranks == 8


def _tp_ranks(spec):
    kind, n = spec.split(":")
    return {"row": int(n), "square": int(n) ** 2, "cube": int(n) ** 3, "subgraph": int(n)}[kind]


def test_unknown_cluster_is_a_clear_error():
    with pytest.raises(gw.GridError, match="unknown cluster"):
        plan.load_cluster("no-such-cluster")


def test_calibrate_writes_a_usable_local_preset(tmp_path):
    import os

    out = tmp_path / "local.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29655"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "bench", "--calibrate", "--out", str(out)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    c = plan.load_cluster(str(out))
    assert c.intra_alpha_s > 0 and c.intra_bandwidth_Bps > 1e6 and c.gemm_flops > 1e8
    rows = plan.plan(2, plan.Model(hidden=64, layers=2, heads=4, seq=32, batch=4), c)
    assert rows and rows[0]["step_time_s"] > 0
