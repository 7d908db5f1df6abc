"""The main job (`gridweave train`): same losses on 1 process, on every grid and in plain
torch; a checkpoint written on one grid continues on another with the uninterrupted losses
(the data reader's position included); validation, learning-rate schedule, MFU, sampling."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from rankpool import TRANSPORT_ENV, launcher_args, mpirun

import gridweave as gw

# The tests' job: a small Llama (GQA: 2 kv heads), byte tokens (fast to prepare), 4 steps
# through warmup and cosine decay, clipped at 1.0 (the defaults).
ARGS = ["--steps", "4", "--hidden", "32", "--layers", "4", "--heads", "4", "--seq", "32", "--batch", "8",
        "--tokenizer", "bytes", "--warmup", "2", "--val-every", "2", "--val-samples", "8", "--sample-tokens", "8",
        "--quiet"]


def _train(tmp, name, *extra, port=29581):
    out = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, "--out", str(out),
                        *launcher_args(), *extra], capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    # every communicator the steps used was made at setup, on every rank (none under a step's kernels)
    made = metrics["communicators"]
    assert len(made) == math.prod(metrics["grid"].values()) and all(m["at_setup"] >= 1 for m in made), made
    assert all(m["after_setup"] == 0 for m in made), [m["late"] for m in made]
    # the peak is the machine's, measured alone (never under contention): no grid's step beats it
    assert all(0 < m <= 1.0 for m in metrics["mfu"]), (metrics["mfu"], metrics["peak_flops_source"])
    return metrics["loss"], out


def _one_host_read_a_step(out, dispatch=0, shapes=0):
    """The census of a run with --host-reads (gw.measure.HostReads, every training step of every
    rank): at most one read of a value on the host a step (the loss, the norm, whether the step
    was taken and the experts' routed slots, together), none inside the grid's ops or the
    optimizer, no tensor made from Python data; the skip and clipping decisions were the device's.
    dispatch: the reads an expert-parallel exchange makes on each rank a step (its sizes: one
    per layer and micro-batch, as Megatron-Core's dropless dispatcher); shapes: the value-dependent
    shapes (a capacity's kept slots: one per layer and micro-batch)."""
    m = json.loads((out / "metrics.json").read_text())
    steps = [s for rank in m["host_reads"] for s in rank]
    assert len(steps) == len(m["loss"]) * math.prod(m["grid"].values()), len(steps)
    for s in steps:
        assert s["reads"]["step"] <= 1 and s["tensors_from_python"] == 0, s
        assert s["reads"]["collective"] == 0 and s["reads"]["optimizer"] == 0, s
        assert s["reads"]["moe_dispatch"] == dispatch and s["shape_syncs"] == shapes, s


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and max(abs(x - y) / abs(y) for x, y in zip(a, b)) < tol


def plain_torch(tmp, steps=4, max_grad_norm=1.0, family="llama", tokenizer="bytes", seq=32):
    """The reference the library shares no training code with: the dense model (same
    initialisation), torch.optim.AdamW (no decay on norms and biases), torch's LambdaLR with
    the warmup + cosine written out here, torch's own clipping, the batches of the same reader;
    (losses, gradient norms)."""
    import torch.nn.functional as F

    gw.data.prepare(tmp, None, tokenizer, 1024)
    tokens = gw.data.open_tokens(tmp)
    cfg = gw.train.TrainConfig(model=family, hidden=32, layers=4, heads=4, seq=seq, batch=8, tokenizer=tokenizer)
    torch.manual_seed(0)
    model = gw.models.build(cfg.model_config(tokens.vocab_size), device="cpu")
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)
    warm, lo = 2, 3e-4

    def factor(s):  # linear warmup over 2 steps, cosine to 3e-4 at the last step
        if s < warm:
            return (s + 1) / warm
        t = (s - warm) / (steps - warm)
        return (lo + 0.5 * (3e-3 - lo) * (1 + math.cos(math.pi * t))) / 3e-3

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    reader = gw.data.Reader(tokens.train, seq, 8, 0)
    losses, norms = [], []
    for _ in range(steps):
        x, y = reader.next()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return plain_torch(tmp_path_factory.mktemp("plain"))[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one"), "one", "--nproc", "1")


def test_one_process_equals_plain_torch(single, plain):
    one, _ = single
    assert one[-1] < one[0]
    assert _close(one, plain), (one, plain)


def test_grid_run_equals_one_process(single, plain, tmp_path):
    one, _ = single
    grid, out = _train(tmp_path, "grid", "--nproc", "4", "--dp", "2", "--pp", "2", "--host-reads", port=29583)
    assert one[-1] < one[0]
    assert _close(grid, one), (grid, one)
    assert _close(grid, plain), (grid, plain)
    _one_host_read_a_step(out)  # the main job's grid (the message-driven pipeline x dp, OffloadAdam)
    assert (out / "loss.png").stat().st_size > 0
    index = gw.train.load_checkpoint(out)
    assert index["step"] == 4 and index["grid"]["pp"] == 2


def test_checkpoint_moves_between_grids(single, tmp_path):
    one, _ = single
    _, first = _train(tmp_path, "first", "--nproc", "4", "--dp", "2", "--pp", "2", "--steps", "2", port=29585)
    later, _ = _train(tmp_path, "later", "--nproc", "2", "--pp", "2", "--resume", str(first), port=29587)
    assert _close(later, one), (later, one)  # steps 1-2 from the checkpoint, 3-4 trained on another grid


def test_checkpoint_exports_a_dense_state_dict(single):
    import torch

    import gridweave as gw
    from gridweave.train import export_dense

    _, out = single
    state = export_dense(out)
    model, tok, _ = gw.train.load_model(out)
    assert model.config.family == "llama" and model.config.kv_heads == 2 and tok.vocab_size == 256
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("spec,port", [
    (["--tp", "cube:2"], 29591),                                   # 3-D on the 2x2x2 cube
    # Megatron x ring attention x pipeline, the gradients' all-reduces started inside the backward
    (["--tp", "row:2", "--sp", "2", "--pp", "2", "--overlap-grad-reduce"], 29593),
    (["--tp", "subgraph:2", "--dp", "2", "--pp", "2", "--phase-times"], 29595),  # SUPER D&SP x dp x pipeline
    (["--tp", "square:2", "--pp", "2"], 29597),                    # SUMMA x pipeline
    (["--tp", "csub:2", "--sp", "2", "--pp", "2"], 29599),         # cSub x ring attention x pipeline
    (["--tp", "row:2", "--sp", "2", "--pp", "2", "--attention", "ulysses"], 29681),  # Megatron x Ulysses x pipeline
    (["--sp", "4", "--pp", "2", "--attention", "usp", "--ulysses-degree", "2"], 29683),  # USP 2 x 2 x pipeline
    (["--tp", "row:2", "--tp-sp", "--sp", "2", "--pp", "2"], 29685),  # Megatron's sequence parallelism x ring x pp
])
def test_composed_grids_train_with_one_process_losses(single, plain, tmp_path, spec, port):
    one, _ = single
    losses, out = _train(tmp_path, "run", "--nproc", "8", *spec, "--host-reads", port=port)
    assert _close(losses, one), (spec, losses, one)
    assert _close(losses, plain), (spec, losses, plain)
    _one_host_read_a_step(out)
    if "--phase-times" in spec:  # where each rank's step went: the phases add up to (most of) the step's wall time
        m = json.loads((out / "metrics.json").read_text())
        phases = m["phase_seconds"]
        assert len(phases) == 8 and all(set(p) == set(gw.measure.StepPhases.NAMES) | {"step"} for p in phases)
        assert all(v >= 0 for p in phases for v in p.values()), phases
        assert all(p["forward"] > 0 and p["backward"] > 0 and p["reduction"] > 0 and p["optimizer"] > 0
                   for p in phases), phases
        assert all(abs(p["step"] - sum(p[k] for k in gw.measure.StepPhases.NAMES)) < 1e-9 for p in phases)
        wall = sum(m["config"]["batch"] * m["config"]["seq"] / t for t in m["tokens_per_s"]) / len(m["tokens_per_s"])
        assert 0.5 * wall < phases[0]["step"] <= wall, (phases[0], wall)  # train_step inside the loop's step


# A Mixtral-style model: 4 experts top-2 in every layer, both auxiliary losses on
MIXTRAL = ["--model", "mixtral", "--experts", "4", "--aux-coef", "0.02", "--z-coef", "0.001"]


@pytest.fixture(scope="module")
def mixtral_single(tmp_path_factory):
    """One process: the dropless run and one with a capacity limit."""
    tmp = tmp_path_factory.mktemp("mixtral")
    return {cap: _train(tmp, f"one-{cap}", "--nproc", "1", *MIXTRAL, "--capacity-factor", cap, port=29701)[0]
            for cap in ("0", "1.0")}


@pytest.mark.parametrize("spec,cap,port", [
    (["--dp", "4", "--pp", "2", "--ep", "2"], "0", 29703),          # ep 2 carved out of dp 4, x pipeline
    (["--tp", "row:2", "--dp", "4", "--pp", "1", "--ep", "2"], "0", 29705),  # Megatron 1-D x dp 4 with ep 2
    # expert tensor parallelism with sequence parallelism (the tokens' shards gathered), x pipeline
    (["--tp", "row:2", "--tp-sp", "--dp", "2", "--pp", "2", "--ep", "2"], "0", 29721),
    (["--dp", "2", "--sp", "4", "--pp", "1", "--ep", "4"], "0", 29707),  # ep 4 over dp x sp (ring attention)
    (["--dp", "4", "--pp", "2", "--ep", "2"], "1.0", 29709),        # with a capacity limit
    (["--dp", "4", "--sp", "2", "--pp", "1", "--ep", "2", "--zero", "1"], "0", 29717),  # ZeRO-1
    (["--dp", "4", "--sp", "2", "--pp", "1", "--ep", "4", "--zero", "3", "--no-offload"], "0", 29719),  # ZeRO-3
    # pp 4 with the default schedule (auto: 1F1B, one micro-batch order on every replica of a stage)
    (["--dp", "2", "--pp", "4", "--ep", "2"], "0", 29741),
])
def test_mixtral_trains_on_composed_grids_with_one_process_losses(mixtral_single, tmp_path, spec, cap, port):
    """Expert parallelism composed with pipeline, tensor and sequence parallelism and ZeRO: the same
    losses as one process (the auxiliary losses' gradients through the same scale), dropless and
    with a capacity (ranked over the micro-batch on every grid). A capacity's drop is a step
    function of the router's probabilities: where a grid's float32 rounding differs from one
    process's (ring attention over sp: 1e-7 in the probabilities), a slot that ties another at an
    expert's boundary can go either way (seen: 7 of 256 slots in one layer of a dp 2 x sp 4 run;
    the byte-level model's windows that start alike tie exactly). So the capacity runs here are on
    a grid whose forward is one process's to the bit (dp x pp), for three steps (once the weights
    moved apart by reduction order: 2.5e-5 at step 4); the drop rule over dp x sp is exact in
    float64 in test_moe.py."""
    one = mixtral_single[cap]
    losses, out = _train(tmp_path, "run", "--nproc", "8", *MIXTRAL, "--capacity-factor", cap, "--host-reads", *spec,
                         port=port)
    assert one[-1] < one[0]
    per_step = 4 // int(spec[spec.index("--pp") + 1]) * 2  # this stage's layers x 2 micro-batches
    _one_host_read_a_step(out, dispatch=per_step, shapes=per_step if cap != "0" else 0)
    steps = 4 if cap == "0" else 3
    assert _close(losses[:steps], one[:steps], tol=1e-5), (spec, losses, one)
    # each step's slots per expert of every layer (all stages'), counted once over the data and tensor ranks
    routed = json.loads((out / "metrics.json").read_text())["tokens_per_expert"]
    assert len(routed) == 4 and all(len(step) == 4 and all(len(layer) == 4 for layer in step) for step in routed)
    slots = [sum(layer) for step in routed for layer in step]
    assert all(n == 8 * 32 * 2 for n in slots) if cap == "0" else all(0 < n <= 8 * 32 * 2 for n in slots), slots
    assert (out / "experts.png").stat().st_size > 0
    # run.png's fourth column, each layer's max / mean load: 20 inches at 90 dpi (a dense run's 15)
    assert int.from_bytes((out / "run.png").read_bytes()[16:20], "big") == 20 * 90


def test_mixtral_checkpoint_moves_between_expert_grids(mixtral_single, tmp_path):
    """Experts saved split over ep 2 (carved out of dp 4) continue split over ep 4 (dp 2 x sp 4):
    a sharded checkpoint's blocks are read back by any grid, the experts' included."""
    one = mixtral_single["0"]
    _, first = _train(tmp_path, "first", "--nproc", "4", *MIXTRAL, "--dp", "4", "--pp", "1", "--ep", "2", "--steps",
                      "2", port=29713)
    later, _ = _train(tmp_path, "later", "--nproc", "8", *MIXTRAL, "--dp", "2", "--sp", "4", "--pp", "1", "--ep", "4",
                      "--resume", str(first), port=29715)
    assert _close(later, one, tol=1e-5), (later, one)


@pytest.mark.parametrize("model,spec,port", [
    # q/k/v biases and a gated shared expert, expert tensor parallelism x pipeline
    ("qwen2-moe", ["--tp", "row:2", "--dp", "2", "--pp", "2", "--ep", "2"], 29727),
    # per-head q/k norms under Megatron's sequence parallelism and ring attention, ep over dp x sp
    ("qwen3-moe", ["--tp", "row:2", "--tp-sp", "--dp", "2", "--sp", "2", "--pp", "1", "--ep", "4"], 29729),
])
def test_qwen_moe_trains_on_composed_grids_with_one_process_losses(tmp_path, model, spec, port):
    args = ["--model", model, "--experts", "4", "--aux-coef", "0.02"]
    one, out = _train(tmp_path, "one", "--nproc", "1", *args, "--host-reads", port=port + 100)
    _one_host_read_a_step(out)  # experts on one process: the grouped GEMM's offsets stay on the device
    losses, out = _train(tmp_path, "run", "--nproc", "8", *args, "--host-reads", *spec, port=port)
    assert one[-1] < one[0]
    assert _close(losses, one, tol=1e-5), (spec, losses, one)
    pp = int(spec[spec.index("--pp") + 1])
    _one_host_read_a_step(out, dispatch=4 // pp * 2)  # the expert-parallel exchange's sizes, as Megatron-Core's


# DeepSeek-V3's routing on the Mixtral-shaped model: sigmoid scores times the routed scale, the
# experts in 2 groups of which a token's come from 1, the balancing bias moved after every step,
# the first layer dense
DEEPSEEK_ROUTING = ["--model", "mixtral", "--experts", "4", "--aux-coef", "0", "--scoring", "sigmoid",
                    "--routed-scale", "2.0", "--expert-groups", "2", "--topk-groups", "1", "--bias-rate", "0.01",
                    "--dense-first", "1"]


def test_auxiliary_loss_free_balancing_moves_the_biases_alike_on_every_grid(tmp_path):
    """DeepSeek-V3 §2.1.2: each step's load counted over the token axes moves every grid's biases
    as one process's; they travel in checkpoints (saved on dp x pp x ep, resumed on row:2 x ep 4):
    the losses and the last biases equal one process's. The busiest expert rank's share of the
    step, from its load and every rank's phases."""
    one, single = _train(tmp_path, "one", "--nproc", "1", *DEEPSEEK_ROUTING, port=29731)
    _, first = _train(tmp_path, "first", "--nproc", "8", *DEEPSEEK_ROUTING, "--dp", "4", "--pp", "2", "--ep", "2",
                      "--steps", "2", port=29733)
    later, out = _train(tmp_path, "later", "--nproc", "8", *DEEPSEEK_ROUTING, "--tp", "row:2", "--dp", "4", "--pp",
                        "1", "--ep", "4", "--resume", str(first), "--log", "jsonl", "--phase-times", port=29735)
    assert one[-1] < one[0] and _close(later, one, tol=1e-5), (later, one)
    ref, ours = (gw.train.load_checkpoint(o)["biases"] for o in (single, out))
    assert set(ref) == set(ours) == {f"layers.{i}.moe.expert_bias" for i in (1, 2, 3)}  # layer 0 dense
    # the rule, from the loads the one-process run logged: b_i = sum over steps of 0.01 sign(mean - load_i)
    loads = json.loads((single / "metrics.json").read_text())["tokens_per_expert"]  # [step][layer][expert]
    for k, layer in enumerate((1, 2, 3)):
        want = [sum(0.01 * ((sum(s[k]) / 4 > s[k][e]) - (sum(s[k]) / 4 < s[k][e])) for s in loads) for e in range(4)]
        name = f"layers.{layer}.moe.expert_bias"
        assert all(round(v / 0.01) == round(w / 0.01) for v, w in zip(want, ref[name])), (name, want, ref[name])
        assert all(round(v / 0.01) == round(w / 0.01) for v, w in zip(ref[name], ours[name])), (name, ref, ours)
    assert any(v for b in ref.values() for v in b), ref  # the loads moved them
    # each sparse layer's load every step, in the log as metrics.json has it
    routed = json.loads((out / "metrics.json").read_text())["tokens_per_expert"]
    logged = [json.loads(x) for x in (out / "logs" / "log.jsonl").read_text().splitlines()[1:]]
    for k, layer in enumerate((1, 2, 3)):
        assert [x[f"moe/layer{layer}/tokens_per_expert"] for x in logged
                if f"moe/layer{layer}/tokens_per_expert" in x] == [step[k] for step in routed[-2:]]
    # the busiest expert rank: the member of the expert line (ep 4: one expert each) sent the most
    # slots, the largest share of a step its ranks spent computing (the phases), the mean rank's
    m = json.loads((out / "metrics.json").read_text())
    slots = [sum(c[j] for step in routed for c in step) for j in range(4)]
    assert sorted({r["member"]: r["slots"] for r in m["expert_ranks"]}.items()) == list(enumerate(slots))
    shares = [(p["forward"] + p["backward"]) / p["step"] for p in m["phase_seconds"]]
    assert [r["compute_share"] for r in m["expert_ranks"]] == pytest.approx(shares, rel=1e-12)
    b, top = m["busiest_expert_rank"], max(range(4), key=lambda j: (slots[j], -j))
    assert b["member"] == top and b["slots_over_even"] == pytest.approx(4 * slots[top] / sum(slots), rel=1e-12)
    assert b["compute_share"] == max(shares[r["rank"]] for r in m["expert_ranks"] if r["member"] == top)
    assert b["mean_compute_share"] == pytest.approx(sum(shares) / 8, rel=1e-12) and 0 < b["compute_share"] < 1
    # the export carries them to transformers' layout of the model (the dense model's buffers)
    model, _, _ = gw.train.load_model(out)
    assert torch.equal(model.layers[1].moe.expert_bias, torch.tensor(ours["layers.1.moe.expert_bias"], device="cpu"))


# A DeepSeek-V3-like model: latent attention, 4 experts (2 groups, a token's from 1) with sigmoid
# scores and the balancing bias moving, a shared expert, the first layer dense
DEEPSEEK_V3 = ["--model", "deepseek-v3", "--experts", "4", "--aux-coef", "0", "--seq-aux-coef", "0.001",
               "--expert-groups", "2", "--topk-groups", "1", "--routed-scale", "2.0", "--bias-rate", "0.01",
               "--dense-first", "1"]


@pytest.fixture(scope="module")
def deepseek_single(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("deepseek"), "one", "--nproc", "1", *DEEPSEEK_V3, port=29737)


@pytest.mark.parametrize("spec,port", [
    (["--dp", "4", "--pp", "2", "--ep", "2"], 29739),  # experts over ep 2 of dp 4 x the pipeline
    # the heads and each expert over tp with Megatron's sequence parallelism, x pp
    (["--tp", "row:2", "--tp-sp", "--dp", "2", "--pp", "2", "--ep", "2"], 29743),
    (["--dp", "4", "--pp", "2", "--ep", "4", "--zero", "3", "--no-offload"], 29745),  # ZeRO-3 x pp, ep 4
    # the sequence over sp (the zigzag ring, values padded to the queries' width) x the heads over tp
    (["--sp", "2", "--tp", "row:2", "--dp", "2", "--ep", "2", "--moe-overlap"], 29747),  # the dispatch overlapped
    (["--sp", "4", "--attention", "usp", "--ulysses-degree", "2", "--dp", "2", "--ep", "4"], 29749),  # USP, ep 4
], ids=["dp-pp-ep", "row-dp-pp-ep", "zero3-pp-ep", "ring-row-dp-ep", "usp-dp-ep"])
def test_deepseek_trains_on_composed_grids_with_one_process_losses(deepseek_single, tmp_path, spec, port):
    """DeepSeek-V3's architecture in the main job (latent attention split as Megatron-Core does,
    its routing and balancing, shared experts, a dense first layer) equals one process on grids
    with ep, pp, tp (with Megatron-SP), sp (ring, USP) and ZeRO-3: the losses (float32, 1e-5) and the balancing biases; each run
    exports to the Hugging Face folder the one-process run exports (transformers' config, every
    tensor within float32's reach), which transformers loads."""
    from gridweave import cli
    from safetensors.torch import load_file

    one, single = deepseek_single
    losses, out = _train(tmp_path, "run", "--nproc", "8", *DEEPSEEK_V3, *spec, port=port)
    assert one[-1] < one[0] and _close(losses, one, tol=1e-5), (spec, losses, one)
    ref, ours = (gw.train.load_checkpoint(o)["biases"] for o in (single, out))
    assert set(ours) == set(ref) and all([round(v / 0.01) for v in ours[k]] == [round(v / 0.01) for v in ref[k]]
                                         for k in ref), (ours, ref)
    exported = []
    for name, run in (("one", single), ("grid", out)):
        assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / f"hf-{name}")]) == 0
        exported.append(load_file(str(tmp_path / f"hf-{name}" / "model.safetensors")))
    theirs, mine = exported
    assert set(mine) == set(theirs) and any(k.endswith("kv_b_proj.weight") for k in mine)
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-3, atol=2e-4) for k in mine), \
        [k for k in mine if not torch.allclose(mine[k], theirs[k], rtol=1e-3, atol=2e-4)]
    assert json.loads((tmp_path / "hf-grid" / "config.json").read_text())["model_type"] == "deepseek_v3"
    tf = pytest.importorskip("transformers")
    with torch.device("cpu"):
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-grid", experts_implementation="eager")
    assert sum(p.numel() for p in hf.parameters()) == sum(v.numel() for k, v in mine.items()
                                                          if not k.endswith("e_score_correction_bias"))


def test_mixtral_checkpoint_moves_from_expert_tensor_parallelism(mixtral_single, tmp_path):
    """Experts split over tp inside (gate_up's rows regrouped [gate | up] per tp block) and over
    ep 2 continue on dp 4 with ep 4 and no tensor parallelism."""
    one = mixtral_single["0"]
    _, first = _train(tmp_path, "first", "--nproc", "4", *MIXTRAL, "--tp", "row:2", "--dp", "2", "--pp", "1",
                      "--ep", "2", "--steps", "2", port=29723)
    later, _ = _train(tmp_path, "later", "--nproc", "4", *MIXTRAL, "--dp", "4", "--pp", "1", "--ep", "4",
                      "--resume", str(first), port=29725)
    assert _close(later, one, tol=1e-5), (later, one)


@pytest.mark.skipif(not gw.launch.mpi_installed(), reason="needs gridweave built with MPI and mpirun")
def test_the_main_job_under_mpirun_gives_one_process_losses(single, tmp_path):
    """--launcher mpirun: the ranks are MPI's, the transport is MPI (no torchrun, no TCP store)."""
    one, _ = single
    losses, out = _train(tmp_path, "mpi", "--nproc", "4", "--launcher", "mpirun", "--dp", "2", "--pp", "2")
    assert _close(losses, one), (losses, one)
    assert gw.train.load_checkpoint(out)["grid"]["pp"] == 2
    assert json.loads((out / "metrics.json").read_text())["backend"] == "mpi"


@pytest.mark.parametrize("spec,port", [(["--tp", "cube:2"], 29601), (["--tp", "row:2", "--sp", "2", "--pp", "2"], 29603)])
def test_gradient_clipping_matches_torch(tmp_path, spec, port):
    """--max-grad-norm: the global norm over the grid (each element once) clips as torch does."""
    ref, norms = plain_torch(tmp_path / "ref", max_grad_norm=0.2)
    assert norms[0] > 0.2  # the clipping is engaged
    losses, _ = _train(tmp_path, "clip", "--nproc", "8", "--max-grad-norm", "0.2", *spec, port=port)
    assert _close(losses, ref), (losses, ref)


def test_checkpoint_reshards_cube_to_row_to_one_process(single, tmp_path):
    import torch

    from gridweave.train import export_dense

    one, _ = single
    _, a = _train(tmp_path, "a", "--nproc", "8", "--tp", "cube:2", "--steps", "2", port=29611)
    _, b = _train(tmp_path, "b", "--nproc", "4", "--tp", "row:2", "--dp", "2", "--steps", "3", "--resume", str(a),
                  port=29613)
    losses, c = _train(tmp_path, "c", "--nproc", "1", "--resume", str(b))
    assert _close(losses, one), (losses, one)  # 2 steps on a cube, 1 on a row, 1 on one process
    # the model moved between grids exactly: b's checkpoint re-saved by one process is equal
    _, d = _train(tmp_path, "d", "--nproc", "1", "--steps", "3", "--resume", str(b))
    sb, sd = export_dense(b), export_dense(d)
    assert sb.keys() == sd.keys() and all(torch.equal(sb[k], sd[k]) for k in sb)


@pytest.mark.parametrize("spec,needle", [
    (["--tp", "cube:3"], "(27 ranks) x --sp 1 does not divide the world of 8"),
    (["--tp", "row:3"], "does not divide the world of 8"),
    (["--tp", "ring:2"], "--tp must be"),
    (["--tp", "row:8"], "do not split over --tp row:8"),
    (["--tp", "subgraph:4", "--dp", "4"], "--dp 4 does not divide the 2 ranks"),
    (["--batch", "6"], "batch 6 does not split into 4 dp shards"),
    (["--sp", "8", "--seq", "24"], "--seq 24 does not split into the 16 chunks"),
])
def test_unsupported_combinations_are_clear_errors(tmp_path, spec, needle):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29621"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, "--nproc", "8", *spec,
                        *launcher_args(), "--out", str(tmp_path / "x")], capture_output=True, text=True,
                       timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and needle in r.stderr + r.stdout, (r.stdout[-1500:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]  # one message


def _launch(tmp, name, world, port, fault=None, extra=()):
    """Ranks started by hand (no torchrun agent), so each one's own error is seen; on MPI one
    mpirun job (a rank's death ends it). Returns (exit code, stderr) per rank (MPI: one)."""
    entry = [os.path.join(os.path.dirname(__file__), "faulty_train.py"), fault] if fault else \
        ["-m", "gridweave.cli", "train"]
    args = [*entry, *ARGS, "--nproc", "0", "--steps", "6", "--checkpoint-every", "2", "--timeout", "20",
            "--out", str(tmp / name), *extra]
    if os.environ.get(TRANSPORT_ENV) == "mpi":
        p = mpirun(world, [*args, "--backend", "mpi"], 150)
        return [(p.returncode, p.stderr)]
    procs = []
    for r in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, *args, "--backend", "gloo"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    return [(p.wait(timeout=150), p.stderr.read()) for p in procs]


def test_a_killed_rank_stops_every_rank_and_a_restart_reproduces(tmp_path):
    import time

    clean = _launch(tmp_path, "clean", 4, 29641, extra=("--dp", "2", "--pp", "2"))
    assert all(rc == 0 for rc, _ in clean), [e[-800:] for _, e in clean]
    t0 = time.monotonic()
    hurt = _launch(tmp_path, "hurt", 4, 29643, fault="3:5", extra=("--dp", "2", "--pp", "2"))
    assert time.monotonic() - t0 < 140
    if len(hurt) == 1:  # MPI: mpirun ends the whole job, reporting the rank that died
        assert hurt[0][0] != 0 and "exit" in hurt[0][1].lower(), hurt[0][1][-1500:]
    else:
        assert hurt[3][0] == 9  # the killed rank
        for rc, err in hurt[:3]:
            assert rc != 0 and ("CommError" in err or "CommTimeout" in err), err[-1500:]
    assert gw.train.load_checkpoint(tmp_path / "hurt")["step"] == 4  # the last complete checkpoint before the fault
    again = _launch(tmp_path, "again", 4, 29645, extra=("--dp", "2", "--pp", "2", "--resume",
                                                         str(tmp_path / "hurt")))
    assert all(rc == 0 for rc, _ in again), [e[-800:] for _, e in again]
    a = json.loads((tmp_path / "clean" / "metrics.json").read_text())["loss"]
    b = json.loads((tmp_path / "again" / "metrics.json").read_text())["loss"]
    assert _close(b, a), (b, a)


@pytest.mark.parametrize("spec,port", [(["--nproc", "1", "--ac", "2"], 29625),
                                       (["--nproc", "4", "--dp", "2", "--pp", "2", "--ac", "auto"], 29627)])
def test_activation_checkpointing_keeps_the_losses(single, tmp_path, spec, port):
    """--ac N recomputes all but every N-th layer's output in backward: the same gradients."""
    one, _ = single
    losses, _ = _train(tmp_path, "ac", *spec, port=port)
    assert _close(losses, one, 1e-5), (losses, one)


def test_axes_not_given_are_derived_from_the_given_ones():
    shape = gw.train.TrainConfig(tp="subgraph:4", dp=2).grid_shape  # once silently pp 2, then "needs 16 ranks"
    assert shape(8) == {"dp": 2, "pp": 1, "sp": 1}
    assert gw.train.TrainConfig(pp=4, layers=4).grid_shape(8) == {"dp": 2, "pp": 4, "sp": 1}
    assert gw.train.TrainConfig(tp="row:2", sp=2).grid_shape(8) == {"dp": 1, "pp": 2, "sp": 2}
    with pytest.raises(gw.GridError, match="needs 16 ranks, the world has 8"):
        gw.train.TrainConfig(dp=4, pp=2, tp="row:2").grid_shape(8)


# Issue 16: every axis at once. 4-D grids on 16 CPU ranks and tensor x dp grids on 8 train like
# one process (docs/guide/modes.md's conformance table lists what each test covers).
@pytest.mark.parametrize("spec,n,port", [
    (["--dp", "2", "--pp", "2", "--tp", "row:2", "--sp", "2"], 16, 29651),                    # Li et al.'s 4-D
    (["--tp", "cube:2", "--dp", "2", "--microbatches", "1"], 16, 29653),                     # 3-D x dp
    (["--tp", "square:2", "--pp", "2", "--sp", "2"], 16, 29655),                             # 2-D x pp x sp
    (["--tp", "subgraph:2", "--dp", "2", "--pp", "2", "--sp", "2"], 16, 29657),              # D&SP x dp x pp x sp
    (["--tp", "csub:2", "--dp", "2", "--sp", "2", "--pp", "2"], 16, 29659),                  # cSub x dp x sp x pp
    (["--tp", "cube:2", "--sp", "2"], 16, 29661),                                            # 3-D x sp
    (["--tp", "row:2", "--dp", "2", "--pp", "2"], 8, 29663),                                 # 1-D x dp x pp
    (["--tp", "square:2", "--dp", "2"], 8, 29665),                                           # 2-D x dp
    (["--tp", "cube:2", "--pp", "2"], 16, 29667),                                            # 3-D x pp
    (["--dp", "2", "--pp", "2", "--sp", "2"], 8, 29669),                                     # sequence x dp x pp
    (["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"], 4, 29671),     # Megatron-LM's interleaving
    (["--tp", "row:2", "--dp", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"], 8, 29673),
])
def test_every_axis_at_once_trains_like_one_process(single, tmp_path, spec, n, port):
    one, _ = single
    losses, out = _train(tmp_path, "grid", "--nproc", str(n), *spec, port=port)
    assert _close(losses, one), (spec, losses, one)
    assert gw.train.load_checkpoint(out)["world_size"] == n


def test_a_resumed_fp16_run_keeps_the_loss_scale(tmp_path):
    """The loss scaler's state is in the checkpoint: resuming gives the uninterrupted run."""
    full, _ = _train(tmp_path, "full", "--nproc", "1", "--precision", "fp16")
    _, half = _train(tmp_path, "half", "--nproc", "1", "--precision", "fp16", "--steps", "2")
    assert gw.train.load_checkpoint(half)["loss_scaler"]["scale"] > 1
    later, _ = _train(tmp_path, "later", "--nproc", "1", "--precision", "fp16", "--resume", str(half))
    assert _close(later, full, 1e-6), (later, full)


def test_the_first_hour_says_what_starts_what_it_makes_and_where_the_run_is(tmp_path):
    """Not quiet: the job's line (launcher, ranks, grid, model, data, output) comes first, before any
    rank starts; the corpus' tokenization is announced and timed; the last line names the run folder
    and the commands that come next."""
    import time

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": "29761"}
    env.pop("RANK", None)
    args = [a for a in ARGS if a != "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "gridweave.cli", "train", *args, "--steps", "2", "--nproc", "2",
                          "--pp", "2", "--out", str(out), *launcher_args()], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
    first = p.stdout.readline()
    first_s = time.perf_counter() - t0
    rest, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    assert first.startswith("gridweave train: ") and "2 rank(s) (1 node(s) x 2)" in first, first
    assert "grid dp 1 x pp 2 x tp none x sp 1" in first and f"output {out}" in first and "M parameters" in first
    lines = rest.strip().splitlines()
    assert any(line.startswith("gridweave train: tokenizing ") for line in lines), lines
    assert any(line.startswith("gridweave train: tokenized: ") for line in lines), lines
    assert lines[-1].startswith(f"gridweave train: done; the run is in {out}") and "gridweave generate --run" in \
        lines[-1] and "gridweave export --run" in lines[-1] and "--resume auto" in lines[-1], lines[-1]
    print(f"the first line after {first_s:.2f} s")  # measured, not asserted: 2 cores shared with the suite


def test_a_restart_compares_the_world_with_the_one_that_last_ran(tmp_path):
    """An elastic job shrunk 6 -> 4 ranks and grown back before the 4-rank world saved: the
    checkpoint is the 6-rank world's, but the world before the growth is the 4 ranks that ran
    (world.json, written whole at each start), so the growth is a change of world; without a
    world.json (a run folder from before it) the checkpoint's world is the one that ran."""
    from types import SimpleNamespace

    from gridweave import train

    manifest = {"world_size": 6, "grid": {"dp": 3, "pp": 2, "sp": 1}, "step": 2}
    assert train.world_before(tmp_path, manifest) is manifest
    train.note_world(tmp_path, SimpleNamespace(world_size=4, axes={"dp": 2, "pp": 2, "sp": 1}))
    before = train.world_before(tmp_path, manifest)
    assert before == {"world_size": 4, "grid": {"dp": 2, "pp": 2, "sp": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [train.WORLD]  # no temporary file left
