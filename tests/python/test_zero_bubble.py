"""The zero-bubble schedules (Qi et al., ICLR 2024: ZB-H1, ZB-V; DeepSeek-V3's DualPipe in a V)
run from their tables by the engine: every gradient and the loss equal the dense model's, each
backward split into B and W where the table splits it."""

import pytest
import torch

from tp_refs import rel

CPU = torch.device("cpu")


def _zero_bubble(ctx, schedule, tp, pp, m, layers_per_chunk=1):
    import gridweave as gw
    from gridweave.schedules import Kind, Placement
    from gridweave.split import deferred_store

    import dataclasses

    mode = gw.modes.parse(tp.removesuffix("+sp"))
    if tp.endswith("+sp"):  # Megatron's sequence parallelism inside 1-D
        mode = dataclasses.replace(mode, sequence=True)
    grid = ctx.init(tp=mode, pp=pp)
    vee = schedule in ("zbv", "dualpipev")
    chunks = 2 if vee else 1
    torch.manual_seed(0)
    dense = gw.models.Llama(64, 32, 4, layers_per_chunk * chunks * pp, 16, kv_heads=2, ffn_hidden=40,
                            dtype=torch.float64, device=grid.device)
    s = grid.coords["pp"]
    stage = gw.models.ModelChunks(dense, grid, mode, s, pp, chunks, Placement.V if vee else Placement.LOOP)
    rows = 2 * m
    ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(1), device=CPU).to(grid.device)
    tgt = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(2), device=CPU).to(grid.device)
    dense.loss(dense(ids), tgt).backward()
    xs, ys = [ids[i * 2:(i + 1) * 2] for i in range(m)], [tgt[i * 2:(i + 1) * 2] for i in range(m)]
    loss, st = gw.pipeline.pipeline_step(stage, grid, xs, ys, stage.loss, stage.activation_shape(2, 16),
                                         dtype=torch.float64, schedule=schedule)
    ref = dict(dense.named_parameters())
    gw.reduce_gradients(stage, grid)
    errs = {k: rel(g, ref[k].grad) for c in stage.chunks for k, g in c.dense_state(True).items()}
    full = dense.loss(dense(ids), tgt).item()
    table = gw.pipeline.table_for(schedule, pp, m, chunks)
    ws = sum(op.kind is Kind.W for op in table.ops[s])
    deferrable = sum(deferred_store(x) is not None for x in stage.modules())
    return errs, (None if loss is None else abs(loss.item() - full) / full), st.forwards, st.backwards, st.weights, \
        ws, deferrable, s


@pytest.mark.parametrize("schedule,tp,pp,m", [
    ("zb1", "none", 2, 2), ("zb1", "none", 2, 5), ("zb1", "none", 4, 8), ("zb1", "row:2", 2, 3),
    ("zb1", "row:2+sp", 2, 4),
    ("zbv", "none", 2, 2), ("zbv", "none", 2, 4), ("zbv", "none", 4, 8), ("zbv", "row:2", 2, 4),
    ("zbv", "row:2+sp", 2, 4),
    ("zbv", "none", 3, 5),
    ("dualpipev", "none", 2, 4), ("dualpipev", "none", 4, 8), ("dualpipev", "none", 2, 5), ("dualpipev", "row:2", 2, 4),
    ("zbv", "square:2", 2, 4), ("zb1", "subgraph:2", 2, 3), ("dualpipev", "csub:2", 2, 4)])
def test_zero_bubble_schedules_equal_the_dense_model(pool, schedule, tp, pp, m):
    """Each stage's ops as the table orders them (gw.schedules), B then W apart where it splits:
    every gradient and the loss equal one process's (float64 1e-10), every forward, backward and
    W run once, and the layers' weights really waited for W (deferrable: the dense linears and
    norms, Megatron's column and row linears, with sequence parallelism's all-gather again in W,
    SUMMA's and SUPER's layers)."""
    import gridweave as gw

    n = pp * gw.modes.parse(tp.removesuffix("+sp")).ranks()
    chunks = 2 if schedule in ("zbv", "dualpipev") else 1
    res = pool.run(_zero_bubble, n, schedule, tp, pp, m)
    losses = [r[1] for r in res if r[1] is not None]
    assert losses and max(losses) < 1e-10
    for errs, _, fw, bw, weights, ws, deferrable, stage in res:
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert fw == bw == chunks * m, (stage, fw, bw)
        assert weights == ws and (ws > 0 or schedule == "dualpipev"), (stage, weights, ws)
        assert deferrable > 0  # the dense and the 1-D tensor-parallel linears alike
    if schedule != "dualpipev":
        assert all(r[5] > 0 for r in res)  # every stage splits some backward


def _bad(ctx, schedule, chunks, m, place=None):
    import gridweave as gw
    from gridweave.schedules import Placement

    grid = ctx.init(pp=2)
    dense = gw.models.GPT(64, 32, 4, 4, 16, device=grid.device)
    s = grid.coords["pp"]
    place = Placement(place) if place else Placement.V if chunks == 2 else Placement.LOOP
    stage = gw.models.ModelChunks(dense, grid, gw.modes.parse("none"), s, 2, chunks, place)
    xs = [torch.zeros(2, 16, dtype=torch.int64, device=grid.device)] * m
    try:
        gw.pipeline.pipeline_step(stage, grid, xs, xs, stage.loss, stage.activation_shape(2, 16), schedule=schedule)
    except gw.GridError as e:
        return str(e)
    return None


@pytest.mark.parametrize("schedule,chunks,m,place,match", [("zbv", 1, 4, None, "runs 2 model chunks"),
                                                           ("zb1", 2, 4, None, "runs 1 model chunk"),
                                                           ("dualpipev", 2, 3, None, "at least twice"),
                                                           ("zbv", 2, 4, "loop", "v placement"),
                                                           ("interleaved", 2, 4, "v", "built in a V")])
def test_a_schedule_that_cannot_run_is_one_clear_error(pool, schedule, chunks, m, place, match):
    """Chunks a schedule does not run (their count or their placement), too few micro-batches: one
    clear error on every stage, before any message."""
    errs = pool.run(_bad, 2, schedule, chunks, m, place)
    assert all(e is not None and match in e for e in errs), errs


# ---- the main job: each schedule composed with the other axes equals one process --------------

JOB = ["--steps", "3", "--hidden", "32", "--layers", "8", "--heads", "4", "--seq", "32", "--batch", "8",
       "--tokenizer", "bytes", "--warmup", "1", "--val-every", "3", "--val-samples", "8", "--sample-tokens", "0",
       "--quiet", "--microbatches", "4"]
MIXTRAL = ["--model", "mixtral", "--experts", "4", "--aux-coef", "0.02", "--z-coef", "0.001"]


def _job(tmp, name, *extra, port):
    import json
    import os
    import subprocess
    import sys

    from rankpool import launcher_args

    out = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *JOB, "--out", str(out), *launcher_args(),
                        *extra], capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())["loss"], out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zb-one")
    return {name: _job(tmp, name, "--nproc", "1", *extra, port=29801)[0]
            for name, extra in (("llama", []), ("mixtral", MIXTRAL), ("packed", ["--pack-documents"]))}


@pytest.mark.parametrize("schedule,spec,n,model,port", [
    ("zb1", ["--dp", "2", "--pp", "2"], 4, "llama", 29803),
    ("zb1", ["--tp", "row:2", "--tp-sp", "--dp", "2", "--pp", "2", "--zero", "2"], 8, "llama", 29805),
    ("zb1", ["--sp", "2", "--pp", "4", "--pack-documents"], 8, "packed", 29807),
    # activation checkpointing (the job's default, ac 1, keeps every layer's activations): each chunk's
    # 2 layers recomputed in B, their weights' gradients deferred to W from there
    ("zbv", ["--dp", "2", "--pp", "2", "--zero", "1", "--ac", "2"], 4, "llama", 29811),
    ("zbv", ["--sp", "2", "--attention", "ulysses", "--dp", "2", "--pp", "2", "--pack-documents"], 8, "packed", 29815),
    ("zbv", ["--dp", "2", "--pp", "2", "--ep", "2"], 4, "mixtral", 29817),
    ("dualpipev", ["--dp", "2", "--pp", "2"], 4, "llama", 29819),
    ("dualpipev", ["--tp", "square:2", "--pp", "2"], 8, "llama", 29821),
    ("dualpipev", ["--sp", "2", "--dp", "2", "--pp", "2", "--zero", "2"], 8, "llama", 29823),
])
def test_the_main_job_on_each_schedule_equals_one_process(one_process, tmp_path, schedule, spec, n, model, port):
    """`--schedule zb1 | zbv | dualpipev` composed with dp, ZeRO 1 and 2, tp (1-D with Megatron-SP,
    2-D), sp (ring, Ulysses), experts over dp, packed documents, with activation checkpointing (ZB-V's
    ZeRO-1 job: each chunk recomputed in B, its layers deferring there) and without: one process's
    losses (float32, 1e-5 relative)."""
    extra = MIXTRAL if model == "mixtral" else []
    losses, _ = _job(tmp_path, schedule, "--nproc", str(n), "--schedule", schedule, *spec, *extra, port=port)
    ref = one_process[model]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-5, (losses, ref)


def test_a_checkpoint_moves_between_schedules(one_process, tmp_path):
    """Two steps on 1F1B, the third resumed on ZB-V (two chunks a stage in a V), and the other way
    from ZB-H1 to interleaved: the uninterrupted run's losses."""
    ref = one_process["llama"]
    for first, then, port in ((["--schedule", "1f1b"], ["--schedule", "zbv"], 29825),
                              (["--schedule", "zb1"], ["--schedule", "interleaved", "--chunks", "2"], 29827)):
        _, half = _job(tmp_path, f"half-{port}", "--nproc", "4", "--dp", "2", "--pp", "2", *first, "--steps", "2",
                       port=port)
        later, _ = _job(tmp_path, f"later-{port}", "--nproc", "4", "--dp", "2", "--pp", "2", *then, "--resume",
                        str(half), port=port)
        assert len(later) == len(ref) and max(abs(a - b) / abs(b) for a, b in zip(later, ref)) < 1e-5, \
            (first, then, later, ref)  # the resumed run carries the first steps' losses


# ---- the planner knows them ---------------------------------------------------------------------

def test_the_planner_takes_each_schedules_bubble_and_memory_from_its_table():
    """plan.bubble_fraction: (p-1)/m for 1F1B, (p-1)/(v m) interleaved, and a zero-bubble table's
    idle over busy time from its simulated step (T_F = T_B = T_W); ZB-H1 at most half of 1F1B's,
    ZB-V and DualPipeV at most a quarter from m = 2p. The activations a stage holds at its peak are
    the table's (chunk activations over the chunks)."""
    import gridweave as gw
    from gridweave import plan, schedules
    from gridweave.plan.predict import activations_in_flight

    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            one = plan.bubble_fraction(p, m)
            assert one == (p - 1) / m and plan.bubble_fraction(p, m, "interleaved", 2) == (p - 1) / (2 * m)
            for name, chunks, goal in (("zb1", 1, 1 / 2), ("zbv", 2, 1 / 4), ("dualpipev", 2, 1 / 4)):
                table = gw.pipeline.table_for(name, p, m, chunks)
                line = schedules.simulate(table, 1 / chunks, 1 / chunks, 1 / chunks)
                idle = line.span * p - sum(line.busy)
                got = plan.bubble_fraction(p, m, name, chunks)
                assert abs(got - idle / sum(line.busy)) < 1e-12 and got <= goal * one, (name, p, m, got, one)
                grid = plan.GridShape(pp=p, schedule=name, chunks=chunks)
                assert [activations_in_flight(grid, s, m) for s in range(p)] == \
                    [k / chunks for k in schedules.peaks(table)]
    assert [activations_in_flight(plan.GridShape(pp=4), s, 8) for s in range(4)] == [4, 3, 2, 1]


def test_plan_ranks_the_schedules_it_is_given_with_the_grids(tmp_path):
    """`gridweave plan --schedules auto,zb1,zbv,dualpipev` ranks each schedule on the grids with
    stages, every one a grid train accepts with that schedule; a schedule it does not know is one
    clear error."""
    import json
    import subprocess
    import sys

    from gridweave.cli import parse_train

    base = ["--batch", "16", "--layers", "8", "--hidden", "64", "--heads", "4", "--seq", "64"]
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "plan", "--gpus", "4", *base, "--json", "--top", "0",
                        "--schedules", "auto,zb1,zbv,dualpipev", "--workers", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    staged = {row["schedule"] for row in rows if row["pp"] > 1}
    assert staged >= {"auto", "zb1", "zbv", "dualpipev"}, staged
    for row in rows:
        if row["pp"] > 1 and row["schedule"] != "auto":
            parse_train([*base, "--dp", str(row["dp"]), "--pp", str(row["pp"]), "--tp", row["tp"], "--sp",
                         str(row["sp"]), "--zero", str(row["zero"]), "--schedule", row["schedule"], "--microbatches",
                         str(row["microbatches"])]).grid_shape(4)
    bad = subprocess.run([sys.executable, "-m", "gridweave.cli", "plan", "--gpus", "4", *base, "--schedules", "zb2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--schedules 'zb2'" in bad.stderr, bad.stderr[-2000:]


# ---- B and W apart, one process ------------------------------------------------------------------

def test_a_split_backward_equals_the_whole_and_fires_each_hook_once():
    """gw.split: a micro-batch's B gives the input's gradient and leaves every deferrable weight
    untouched (no hook fired); its W adds exactly the whole backward's weight gradients (float64,
    bitwise here), each weight's post-accumulate hook once; an input with no gradient (nothing for B
    to reach) takes its weight gradients in the backward; out of a split micro-batch the linears are
    torch's."""
    import collections

    import gridweave as gw
    from gridweave.split import WeightStore, defer_weights, deferred_store

    torch.manual_seed(0)

    def model():
        kw = dict(dtype=torch.float64, device=CPU)  # the suite may poison the default device
        return torch.nn.Sequential(torch.nn.Linear(6, 5, **kw), torch.nn.LayerNorm(5, **kw), torch.nn.GELU(),
                                   torch.nn.Linear(5, 4, bias=False, **kw))
    whole, split = model(), model()
    split.load_state_dict(whole.state_dict())
    store = WeightStore()
    assert defer_weights(split, store) == 3 and deferred_store(split[0]) is store and deferred_store(split[1]) is store
    assert deferred_store(split[2]) is None  # GELU: no weights
    fired = collections.Counter()
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: fired.update([name]))
    x = torch.randn(3, 7, 6, dtype=torch.float64, device=CPU)
    for mb in range(2):
        a, b = x[:, mb:mb + 3].clone().requires_grad_(), x[:, mb:mb + 3].clone().requires_grad_()
        whole(a).square().sum().backward()
        store.current = mb
        split(b).square().sum().backward()
        store.current = None
        assert torch.equal(a.grad, b.grad)
        assert split[0].weight.grad is None if mb == 0 else True
        assert store.pending == [mb] and fired["0.weight"] == fired["1.weight"] == fired["3.weight"] == mb
        store.run(mb)
        assert store.pending == []
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert fired[name] == 2, (name, fired)
    # a linear called twice in a micro-batch: W sums its two shares, its hook fires once
    twice, once = torch.nn.Linear(5, 5, dtype=torch.float64, device=CPU), collections.Counter()
    ref = torch.nn.Linear(5, 5, dtype=torch.float64, device=CPU)
    ref.load_state_dict(twice.state_dict())
    twice.weight.register_post_accumulate_grad_hook(lambda t: once.update(["w"]))
    defer_weights(twice, store)
    z = torch.randn(4, 5, dtype=torch.float64, device=CPU, requires_grad=True)
    ref(ref(z)).sum().backward()
    store.current = 7
    twice(twice(z.detach().requires_grad_())).sum().backward()
    store.current = None
    store.run(7)
    assert once["w"] == 1 and torch.equal(twice.weight.grad, ref.weight.grad) and torch.equal(twice.bias.grad,
                                                                                               ref.bias.grad)
    # the first linear's input has no gradient: its weights' gradients come in the backward; the
    # norm's and the second linear's inputs (after the first's weights) have one: they wait
    split.zero_grad()
    store.current = 0
    split(x[:, :3]).square().sum().backward()
    store.current = None
    assert split[0].weight.grad is not None and split[3].weight.grad is None and split[1].weight.grad is None
    assert store.pending == [0]
    store.run(0)
    assert split[3].weight.grad is not None and split[1].bias.grad is not None
    # under activation checkpointing (torch's, non-reentrant) a block of deferring layers runs its
    # forward again once, in B, as the whole backward does, and never in W; the gradients equal
    from torch.utils.checkpoint import checkpoint

    runs = collections.Counter()

    def block(m, t, key):
        runs[key] += 1
        return m(t)
    whole.zero_grad(set_to_none=True)
    split.zero_grad(set_to_none=True)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    checkpoint(block, whole, a, "whole", use_reentrant=False).square().sum().backward()
    store.current = 3
    checkpoint(block, split, b, "split", use_reentrant=False).square().sum().backward()
    store.current = None
    assert runs == {"whole": 2, "split": 2} and split[1].weight.grad is None and torch.equal(a.grad, b.grad)
    store.run(3)
    assert runs["split"] == 2
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        assert torch.equal(p.grad, q.grad), name
    with pytest.raises(gw.GridError):
        gw.pipeline.table_for("zbv", 2, 4, 1)


# ---- every layer's backward apart: B, then W --------------------------------------------------

def _layers_apart(ctx, family, tp, sp, dp, attention, ep, ac):
    """One stage of the whole model on this grid, its backward fused, then split (every layer
    deferring into one store: B, then W): the weights whose gradient came in B, and each
    gradient's difference from the fused backward's."""
    import dataclasses

    import gridweave as gw
    from gridweave.nn.moe import MoE, expert_line
    from gridweave.split import WeightStore, defer_weights

    mode = gw.modes.parse(tp.removesuffix("+sp"))
    if tp.endswith("+sp"):
        mode = dataclasses.replace(mode, sequence=True)
    grid = ctx.init(tp=mode, sp=sp, dp=dp)
    moe = MoE(experts=4, top_k=2, ffn=8, shared_ffn=6) if family in ("mixtral", "qwen3") else None
    cfg = gw.models.ModelConfig("llama" if moe else family, 64, 32, 4, 2, 16, ffn_hidden=40, moe=moe,
                                qk_norm=family == "qwen3", linformer_k=4 if attention == "linformer" else None)
    torch.manual_seed(0)
    dense = gw.models.build(cfg, dtype=torch.float64, device=grid.device)
    opts = dict(ep=expert_line(grid, ep)) if ep else {}
    stage = gw.models.GPTStage(dense, grid, mode, 0, 1, ac=ac, attention=attention, **opts)
    g = torch.Generator(device="cpu").manual_seed(1 + grid.coords["dp"])
    x = torch.randint(0, 64, (4, 16), generator=g, device=CPU).to(grid.device)  # the cube splits 4 ways
    y = torch.randint(0, 64, (4, 16), generator=g, device=CPU).to(grid.device)
    stage.loss(stage(x), y).backward()
    fused = {k: p.grad.clone() for k, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    store = WeightStore()
    layers = defer_weights(stage, store)
    store.current = 0
    stage.loss(stage(x), y).backward()
    store.current = None
    in_b = sorted(k for k, p in stage.named_parameters() if p.grad is not None)
    store.run(0)
    errs = {k: (rel(p.grad, fused[k]) if p.numel() else float(p.grad is None)) for k, p in stage.named_parameters()}
    return errs, in_b, layers


@pytest.mark.parametrize("family,tp,sp,dp,attention,ep,ac", [
    ("llama", "none", 1, 1, "ring", 0, 1), ("llama", "row:2", 1, 1, "ring", 0, 1),
    ("llama", "row:2+sp", 1, 1, "ring", 0, 2), ("gpt", "square:2", 1, 1, "ring", 0, 1),
    ("gpt", "cube:2", 1, 1, "ring", 0, 2), ("llama", "square:2", 1, 1, "ring", 0, 1),
    ("gpt", "subgraph:2", 1, 1, "ring", 0, 1), ("gpt", "csub:2", 1, 1, "ring", 0, 1),
    ("llama", "none", 2, 1, "ring", 0, 1), ("llama", "none", 2, 1, "ulysses", 0, 2),
    ("llama", "none", 4, 1, "usp", 0, 1), ("bert", "none", 2, 1, "linformer", 0, 1),
    ("bert", "row:2", 1, 1, "ring", 0, 1), ("mixtral", "none", 1, 2, "ring", 2, 1),
    ("qwen3", "row:2", 1, 2, "ring", 2, 2)])
def test_every_layers_split_backward_equals_its_fused_backward(pool, family, tp, sp, dp, attention, ep, ac):
    """Qi et al.'s B and W apart in every layer: 1-D with and without Megatron's sequence
    parallelism, 2-D (SUMMA's weight products and its vectors' reduce-scatters in W), 3-D (the
    cube's weight product, Algorithm 8 for the vectors), SUPER's branches (D&SP and cSub), ring,
    Ulysses and USP attention, BERT with Linformer's projections, the vocabulary-parallel head and
    loss, Mixtral's and Qwen3's experts (expert and expert-tensor parallel, Qwen3's head norms),
    with and without activation checkpointing: after B only the embeddings have gradients (their
    input has none: nothing waits for them), and after W every gradient equals the fused
    backward's (float64 1e-10)."""
    import gridweave as gw

    mode = gw.modes.parse(tp.removesuffix("+sp"))
    for errs, in_b, layers in pool.run(_layers_apart, sp * dp * mode.ranks(), family, tp, sp, dp, attention, ep, ac):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert in_b and all(k.startswith("embed.") and ".ln." not in k for k in in_b), in_b
        assert layers > 0
