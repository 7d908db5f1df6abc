"""gridweave verify: a job's parallel configuration, scaled down, against the dense model in one
process (float64), and bugs planted on purpose found, named by module and rank."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest


def _verify(ctx, job: dict, plant: str | None = None, steps: int = 2):
    """verify.run on this pool's ranks, with a bug planted (and removed after) on them."""
    import gridweave as gw
    from gridweave import models, verify
    from gridweave.config import TrainConfig
    from gridweave.grid import Grid

    undo = []
    if plant == "collective":  # rank 1's sums over tp come back a little off
        original = Grid.all_reduce

        def off(self, t, *a, **kw):
            out = original(self, t, *a, **kw)
            if self.rank == 1 and kw.get("axis", a[0] if a else None) in ("tp", ("tp",)) and t.is_floating_point():
                out.add_(1e-7)
            return out
        Grid.all_reduce = off
        undo.append(lambda: setattr(Grid, "all_reduce", original))
    elif plant == "layout":  # the MLP's second projection's gradient forgets its sum over dp
        cls = models.GPTStage
        original_init = cls.__init__

        def init(self, *a, **kw):
            original_init(self, *a, **kw)
            for name, p, _ in self.sharded_items():
                if name == "layers.1.fc2.weight":
                    pl = gw.sharding.placement_of(p)
                    p.placement = dataclasses.replace(pl, partial=tuple(a for a in pl.partial if a != "dp"))
        cls.__init__ = init
        undo.append(lambda: setattr(cls, "__init__", original_init))
    elif plant == "sequence":  # sp rank 1 embeds its neighbour's tokens (a shard swapped)
        cls = models.GPTStage
        original_shard = cls.shard_tokens

        def swapped(self, t, order=None):
            if self.seq is None or self.grid.coords["sp"] != 1:
                return original_shard(self, t, order)
            return t[:, :t.shape[1] // self.grid.axes["sp"]]  # the first positions: not this rank's
        cls.shard_tokens = swapped
        undo.append(lambda: setattr(cls, "shard_tokens", original_shard))
    try:
        report = verify.run(TrainConfig(**job), steps=steps, world=ctx.world_size, init=ctx.init)
    finally:
        for u in undo:
            u()
    return report.to_dict()


# The composed grids of the suite's main-job tests, each verified on its own ranks: every one equal
# to one process within 1e-9 in float64 (the largest difference printed by the report).
COMPOSED = [
    (dict(tp="row:2", dp=2, pp=1, zero=1), 4),
    (dict(tp="row:2", sp=2, pp=2, offload=False), 8),  # the optimizer state on the device (DistributedAdam)
    (dict(tp="subgraph:2", dp=2, pp=2), 8),
    (dict(tp="cube:2", pp=1), 8),
    (dict(tp="csub:2", sp=2, pp=2, ac=2), 8),
    (dict(sp=4, pp=2, attention="usp", ulysses_degree=2), 8),
    (dict(tp="row:2", tp_sp=True, sp=2, pp=2, pack_documents=True), 8),
    (dict(model="mixtral", ep=2, dp=2, sp=2, pp=1, zero=3, capacity_factor=1.0), 4),
    (dict(model="bert", tp="square:2", dp=2, pp=1), 8),
    (dict(tp="row:2", dp=2, pp=2, schedule="interleaved", chunks=2, zero=3, fused_loss=True), 8),
    (dict(dp=4, pp=1, zero=2, zero_shard_group="node"), 4),  # hybrid sharding over the replica's two halves
]


@pytest.mark.parametrize("job,n", COMPOSED, ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_verify_passes_on_the_composed_grids(pool, job, n):
    reports = pool.run(_verify, n, job, timeout=300)
    assert all(r == reports[0] for r in reports), "every rank returns the same report"
    r = reports[0]
    assert r["ok"], r["line"]
    assert r["worst"] < 1e-11 and r["compared"] > 0, r["line"]
    assert r["line"].startswith("verify: ok (2 steps on"), r["line"]


def test_experts_no_row_reached_keep_the_reductions_in_step(pool):
    """The fuzzer's first find (`gridweave verify --fuzz 60 --seed 2026`, its 17th draw): float64
    experts (the loop over experts, not grouped_mm) skipped an expert no row reached, so its weights
    got no gradient that micro-batch; the optimizer's hooks then started the overlapped reductions
    over sp at different points on different ranks, and the interleaved schedule deadlocked (an sp
    all-reduce on two ranks, the experts' exchange on the other two: its flight recorder's report)."""
    job = dict(model="qwen2-moe", experts=4, ep=4, sp=4, pp=2, dp=1, schedule="interleaved", chunks=2,
               attention="rsa", layers=8, hidden=64, seq=64, batch=16, seed=515, timeout=30.0)
    r = pool.run(_verify, 8, job, timeout=300)[0]
    assert r["ok"], r["line"]


def test_a_perturbed_collective_is_named_with_its_module_and_rank(pool):
    r = pool.run(_verify, 4, dict(tp="row:2", dp=2, pp=1), "collective", timeout=300)[0]
    assert not r["ok"]
    first = r["first"]
    # the first sum over tp is the vocabulary-parallel embedding's (Megatron-LM §3), on rank 1 alone
    assert (first["step"], first["phase"], first["module"], first["rank"]) == (0, "forward", "embed", 1), r["line"]
    assert first["coords"]["tp"] == 1 and 1e-12 < first["error"], r["line"]
    assert first["after"].startswith("all_reduce #") and " over tp " in first["after"], r["line"]  # its flight recorder
    assert r["line"].startswith("verify: diverged at step 0, forward: embed output of micro-batch 0 on rank 1")


def test_a_layout_that_forgets_dp_is_named_in_the_backward(pool):
    r = pool.run(_verify, 4, dict(dp=2, sp=2, pp=1), "layout", timeout=300)[0]
    assert not r["ok"]
    first = r["first"]
    assert (first["step"], first["phase"]) == (0, "backward"), r["line"]
    assert first["module"] == "layers.1.fc2" and first["tensor"] == "weight's gradient", r["line"]
    assert "gradient" in first["tensor"] and "reduction over" in first["after"], r["line"]


def test_a_swapped_sequence_shard_is_named_at_the_embedding(pool):
    r = pool.run(_verify, 4, dict(dp=2, sp=2, pp=1), "sequence", timeout=300)[0]
    assert not r["ok"]
    first = r["first"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", "embed"), r["line"]
    assert first["coords"]["sp"] == 1 and first["error"] > 0.1, r["line"]


def test_the_replica_keeps_what_can_go_wrong_and_says_what_it_reduced():
    import gridweave as gw
    from gridweave import verify
    from gridweave.config import TrainConfig

    job = TrainConfig(tp="row:8", dp=64, pp=8, zero=1, layers=32, hidden=4096, heads=32, kv_heads=8, seq=4096,
                      batch=1024, microbatches=16, schedule="1f1b", ac=2)
    replica, lines, world = verify.scale_down(job, 8 * 64 * 8, ranks=8)
    # each degree halved, the largest first, to 2: dp 2 x pp 2 x row:2 on 8 ranks
    assert (replica.dp, replica.pp, replica.tp, world) == (2, 2, "row:2", 8)
    # what can go wrong kept: ZeRO 1, 1F1B, activation checkpointing, 4 query heads per key/value head, a
    # key/value head per tensor rank (8 over row:8 then, 2 over row:2 now)
    assert (replica.zero, replica.schedule, replica.ac, replica.precision) == (1, "1f1b", 2, "fp64")
    assert replica.heads // replica.kv_heads == 4 and replica.kv_heads // 2 == job.kv_heads // 8
    assert replica.layers == 2 * 2 and replica.hidden % replica.heads == 0
    assert "dp 64 -> 2" in lines and "tp row:8 -> row:2" in lines and "layers 32 -> 4" in lines
    # what fits stays: experts over a part of the data line (4 of 8), USP's blocks of 4 in a ring of 2
    moe, _, _ = verify.scale_down(TrainConfig(model="mixtral", dp=8, pp=1, ep=4, layers=2), 8, ranks=8)
    assert (moe.dp, moe.ep) == (8, 4)
    usp, _, _ = verify.scale_down(TrainConfig(sp=8, pp=1, attention="usp", ulysses_degree=4, layers=2), 8, ranks=8)
    assert (usp.sp, usp.ulysses_degree) == (8, 4)
    # experts over a part of the line stay a part when the line shrinks (it keeps 4 ranks), and it is said
    part, lines, world = verify.scale_down(TrainConfig(model="mixtral", tp="row:2", dp=8, pp=2, ep=2, layers=4),
                                           32, ranks=16)
    assert (part.dp, part.ep, world) == (4, 2, 16) and "dp 8 -> 4" in lines
    assert moe.top_k < moe.experts  # routing still chooses
    # larger jobs need more ranks than the CPU is given: one clear error, before anything starts
    with pytest.raises(gw.GridError, match="more than ranks=8"):
        verify.scale_down(TrainConfig(tp="cube:2", dp=2, pp=2, layers=4), 32, ranks=8)


def test_gridweave_verify_on_the_command_line(tmp_path):
    """gridweave verify takes train's flags: ok and exit 0; a job train refuses, train's error and exit 2."""
    env = {**os.environ, "GRIDWEAVE_PORT": "29731"}
    ok = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", "--nproc", "4", "--tp", "row:2",
                         "--pp", "2", "--layers", "8", "--schedule", "1f1b"], capture_output=True, text=True,
                        env=env, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("verify: ok (2 steps on 4 ranks, llama on pp 2 x tp row:2")
    # --config's job is the one the ranks verify (its values under the flags given)
    (tmp_path / "job.toml").write_text('[model]\nmodel = "gpt"\n')
    toml = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", "--nproc", "2", "--config",
                           str(tmp_path / "job.toml")], capture_output=True, text=True, env=env, timeout=300)
    assert toml.returncode == 0, toml.stdout + toml.stderr
    assert toml.stdout.strip().splitlines()[-1].startswith("verify: ok (2 steps on 2 ranks, gpt on pp 2"), toml.stdout
    bad = subprocess.run([sys.executable, "-m", "gridweave.cli", "verify", "--nproc", "4", "--tp", "row:3"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("gridweave verify: "), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_fuzzers_configurations_equal_one_process(pool):
    """A fixed seed's draws (every family, mode, axis and option train accepts, on up to 8 ranks),
    each verified: the suite's share of `gridweave verify --fuzz`."""
    import random

    from gridweave import verify

    rng = random.Random(2026)
    for _ in range(12):
        cfg, world = verify.draw(rng, 8)
        job = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
        r = pool.run(_verify, world, job, timeout=300)[0]
        assert r["ok"], f"{verify.describe(cfg, world)}: {r['line']}"


def test_the_fuzzers_repro_command_is_the_configuration_it_drew():
    """Each failure's repro line is `gridweave verify` with the drawn configuration's flags: read back
    by the command line, they make the same configuration."""
    import random

    from gridweave import cli, verify

    rng = random.Random(7)
    parser = cli._Parser(prog="gridweave")
    sub = parser.add_subparsers(dest="command")
    cli._verify_parser(sub)
    for _ in range(40):
        cfg, world = verify.draw(rng, 8)
        args = parser.parse_args(["verify", "--nproc", str(world), *cli._flags_of(cfg)])
        again = cli.train_config(args)
        assert again == cfg, (cli._flags_of(cfg), cfg, again)
