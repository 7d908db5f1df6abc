"""The encoder Li et al. trains (issue 31): BERT's masked LM, and Linformer with sequence
parallelism (Li et al. §4.3). The independent references: transformers' BertForMaskedLM (logits,
the masked-LM loss and every gradient, float64), Linformer's formula written out here, and the
dense single-process model for every grid; the main job against one process."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from rankpool import launcher_args
from tp_refs import DEVICE, full, rel

V, H, HEADS, L, B = 64, 32, 4, 16, 4
MASK = V - 1  # the mask token: past the text's tokens


def _perturbed(model):
    """Norms and biases off their initial ones and zeros, so every parameter shows in a check."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.05 * full(p.shape, 100 + i, p.dtype, p.device))
    return model


def _masked(rows, seed=0):
    import gridweave as gw

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, MASK, (rows, L), generator=g, device="cpu")
    x, y = gw.data.masked_lm(ids, range(rows), seed, MASK, MASK)
    return x.to(DEVICE), y.to(DEVICE)


# ---- BERT against transformers -------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_bert_equals_transformers_bert_for_masked_lm(tie):
    """from_hf gives BertForMaskedLM's logits; the masked-LM loss (labels -100 elsewhere) and the
    gradient of every parameter equal transformers' (float64); to_hf gives the same model back."""
    tf = pytest.importorskip("transformers")
    import gridweave as gw

    cpu = torch.device("cpu")
    with cpu, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BERT's dropout: gridweave trains without it (evaluation is the same)
        c = tf.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                          intermediate_size=48, max_position_embeddings=L, tie_word_embeddings=tie,
                          pad_token_id=None)  # a padding row would take no gradient: no padding here
        torch.manual_seed(0)
        hf = _perturbed(tf.BertForMaskedLM(c).double().eval())
        ours = gw.models.from_hf(hf)
    assert ours.config.family == "bert" and ours.config.tie == tie and not ours.config.causal
    x, y = (t.cpu() for t in _masked(3))
    out = hf(input_ids=x, labels=y)
    logits = ours(x)
    assert rel(logits, out.logits) < 1e-12
    loss = gw.models.GPT.loss(logits, y)
    assert abs(loss.item() - out.loss.item()) < 1e-12
    out.loss.backward()
    loss.backward()
    theirs = dict(hf.named_parameters(remove_duplicate=False))
    # every gradient, through the name table (q|k|v concatenated; segment 0 folded into the positions)
    mine = gw.models.hf._hf_state({k: p.grad for k, p in ours.named_parameters(remove_duplicate=False)}, ours.config)
    mine.pop(gw.models.hf._SEGMENTS)  # ours has none: segment 0's gradient is the positions' summed
    if not tie:  # untied, transformers' decoder holds a bias of its own and cls.predictions.bias is unused
        assert theirs.pop("cls.predictions.bias").grad is None and mine.pop("cls.predictions.bias") is not None
    assert rel(theirs[gw.models.hf._SEGMENTS].grad[0], ours.embed.pos.weight.grad.sum(0)) < 1e-10
    for name, g in mine.items():  # the key bias's gradient is zero (softmax ignores a shift): absolute there
        t = theirs[name].grad
        assert float((g - t).abs().max()) < 1e-10 * max(float(t.abs().max()), 1e-3), name
    with cpu:
        back = gw.models.to_hf(ours)
    assert rel(back(input_ids=x).logits, out.logits) < 1e-12


def test_bert_export_folder_loads_in_from_pretrained(tmp_path):
    tf = pytest.importorskip("transformers")
    import gridweave as gw

    torch.manual_seed(1)
    ours = _perturbed(gw.models.Bert(V, H, HEADS, 2, L, tie=True, dtype=torch.float64, device="cpu"))
    gw.hf.save_hf(ours, tmp_path)
    with torch.device("cpu"):
        hf = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    x, _ = (t.cpu() for t in _masked(2))
    assert rel(ours(x), hf(input_ids=x).logits) < 1e-12


# ---- Linformer: the formula, then every grid -------------------------------------------------

def test_dense_linformer_is_the_papers_formula():
    """Linformer (Wang et al. 2020, Eq. 7), written out here: per head softmax(Q (E K)^T / sqrt(d)) (F V)
    with E, F (K x L) shared by the heads; the dense layer (post-norm, bidirectional) computes it."""
    import gridweave as gw

    K = 4
    arch = gw.nn.Arch(gw.nn.Norm.LAYER, gw.nn.Activation.GELU, eps=1e-12, post_norm=True, linformer=(K, L))
    torch.manual_seed(2)
    layer = _perturbed(gw.nn.DenseTransformerLayer(H, HEADS, causal=False, dtype=torch.float64, device=DEVICE,
                                                   arch=arch))
    x = full((B, L, H), 3)
    d = H // HEADS
    q, k, v = layer.qkv(x).split(H, dim=-1)
    q, k, v = (t.reshape(B, L, HEADS, d).permute(0, 2, 1, 3) for t in (q, k, v))
    E, F = layer.lowrank
    kp, vp = E @ k, F @ v  # (B, heads, K, d)
    scores = q @ kp.transpose(-1, -2) / d ** 0.5
    p = torch.exp(scores - scores.max(-1, keepdim=True).values)
    attn = (p / p.sum(-1, keepdim=True)) @ vp
    h = torch.nn.functional.layer_norm(x + layer.proj(attn.permute(0, 2, 1, 3).reshape(B, L, H)), (H,),
                                       layer.ln1.weight, layer.ln1.bias, 1e-12)
    m = layer.fc2(torch.nn.functional.gelu(layer.fc1(h)))
    ref = torch.nn.functional.layer_norm(h + m, (H,), layer.ln2.weight, layer.ln2.bias, 1e-12)
    assert rel(layer(x), ref) < 1e-12


def _mode(tp):
    import gridweave as gw

    if tp == "row:2+sp":  # Megatron's sequence parallelism inside 1-D
        return gw.Row(2, sequence=True)
    return gw.modes.parse(tp)


def _model(ctx, tp, sp, dp, attention, linformer_k, ulysses_degree):
    """The whole BERT (embedding, 2 layers, masked-LM head) on a grid: logits, the masked-LM loss
    over the global batch's predicted tokens, and every gradient, against the dense model."""
    import gridweave as gw

    mode = _mode(tp)
    grid = ctx.init(tp=mode, sp=sp, dp=dp)
    cfg = gw.models.ModelConfig("bert", V, H, HEADS, 2, L, linformer_k=linformer_k)
    torch.manual_seed(0)
    dense = _perturbed(gw.models.build(cfg, dtype=torch.float64, device=DEVICE))
    stage = gw.models.GPTStage(dense, grid, mode, 0, 1, attention=attention, ulysses_degree=ulysses_degree)
    x, y = _masked(B * dp)
    logits = dense(x)
    gw.models.GPT.loss(logits, y).backward()
    rows = slice(grid.coords["dp"] * B, (grid.coords["dp"] + 1) * B)  # this replica's samples
    mine = stage(x[rows])
    # each replica's sum over its predicted tokens / the global count; gradients summed over dp
    stage.loss(mine, y[rows], normalizer=float((y != gw.models.IGNORE).sum())).backward()
    gw.reduce_gradients(stage, grid)
    errs = {"logits": rel(stage.full_logits(mine), logits[rows])}
    if linformer_k:  # E and F split by columns as the sequence is: L/N of them on each rank
        errs["columns"] = float(stage.layers[0].attn.lowrank.shape[-1] != L // sp)
    grads = stage.dense_state(pick=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    return errs


@pytest.mark.parametrize("tp,sp,dp,attention,k,u", [
    ("none", 4, 1, "ring", None, 1), ("none", 2, 2, "rsa", None, 1), ("none", 4, 1, "ulysses", None, 1),
    ("none", 4, 2, "usp", None, 2), ("row:2", 2, 2, "ring", None, 1), ("row:2+sp", 2, 1, "ring", None, 1),
    ("square:2", 1, 2, "ring", None, 1), ("cube:2", 1, 1, "ring", None, 1), ("subgraph:2", 2, 1, "ring", None, 1),
    ("none", 4, 1, "linformer", 4, 1), ("none", 2, 2, "linformer", 4, 1), ("row:2", 2, 2, "linformer", 4, 1),
    ("row:2+sp", 2, 1, "linformer", 4, 1), ("square:2", 2, 1, "linformer", 8, 1), ("cube:2", 1, 1, "linformer", 4, 1)])
def test_bert_on_every_mode_equals_the_dense_model(pool, tp, sp, dp, attention, k, u):
    """BERT's masked LM (float64, logits and every gradient) on the sp algorithms, 1-D with and
    without Megatron's sequence parallelism (vocab-parallel head and loss with unpredicted tokens),
    2-D, 3-D and SUPER's branches, with dp; and Linformer with the sequence split over sp (the partial
    E_i K_i, F_i V_i all-reduced), over tp's heads, and in the 2-D and 3-D layouts."""
    import gridweave as gw

    n = sp * dp * _mode(tp).ranks()
    for errs in pool.run(_model, n, tp, sp, dp, attention, k, u):
        assert max(errs.values()) < 1e-10, {name: e for name, e in errs.items() if e >= 1e-10}


# ---- data ----------------------------------------------------------------------------------

def test_masked_lm_draws_bert_proportions_the_same_on_every_grid():
    """15% of the tokens predicted, of those 80% [MASK], 10% a random token, 10% kept (Devlin et
    al. §3.1), within 4 standard deviations over 64k tokens; a sample's masks depend on its global
    index only, so two data-parallel readers give the rows one reader gives."""
    import numpy as np

    import gridweave as gw

    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, 200, (256, 256), generator=g, device="cpu")
    x, y = gw.data.masked_lm(ids, range(256), 3, 200, 200)
    picked = y != gw.models.IGNORE
    n, k = ids.numel(), int(picked.sum())
    assert abs(k / n - 0.15) < 4 * (0.15 * 0.85 / n) ** 0.5
    assert torch.equal(y[picked], ids[picked]) and torch.equal(x[~picked], ids[~picked])
    masked, kept = int((x[picked] == 200).sum()), int((x[picked] == ids[picked]).sum())
    for share, want in ((masked / k, 0.8), (kept / k, 0.1 + 0.9 / 200)):
        assert abs(share - want) < 4 * (want * (1 - want) / k) ** 0.5, (share, want)
    assert not torch.equal(gw.data.masked_lm(ids, range(256), 4, 200, 200)[1], y)  # the seed matters

    tokens = np.arange(20_000, dtype=np.uint16) % 200
    one = gw.data.Reader(tokens, 32, 8, seed=1)
    two = [gw.data.Reader(tokens, 32, 8, seed=1, dp_rank=r, dp=2) for r in range(2)]
    for _ in range(2):
        a = one.next_masked(200, 200)
        b = [r.next_masked(200, 200) for r in two]
        for i in range(2):
            assert torch.equal(a[i], torch.cat([b[0][i], b[1][i]]))


# ---- bad input -------------------------------------------------------------------------------

def test_encoder_and_linformer_bad_input_fails_before_anything_runs():
    import gridweave as gw

    with pytest.raises(gw.GridError, match="Linformer is not causal"):
        gw.models.ModelConfig("llama", linformer_k=4)
    with pytest.raises(gw.GridError, match="Linformer is not causal"):
        gw.nn.DenseTransformerLayer(H, HEADS, causal=True, arch=gw.nn.Arch(linformer=(4, L)), device=DEVICE)
    with pytest.raises(gw.GridError, match="attention=linformer and linformer_k go together"):
        gw.train.TrainConfig(model="bert", attention="linformer")
    with pytest.raises(gw.GridError, match="attention=linformer and linformer_k go together"):
        gw.train.TrainConfig(model="bert", linformer_k=8)
    with pytest.raises(gw.GridError, match="Linformer is not causal"):
        gw.train.TrainConfig(model="gpt", attention="linformer", linformer_k=8)
    with pytest.raises(gw.GridError, match="pack_documents is the decoders'"):
        gw.train.TrainConfig(model="bert", pack_documents=True)
    with pytest.raises(gw.GridError, match="SUPER's branches run the ring"):
        gw.train.TrainConfig(model="bert", attention="linformer", linformer_k=8, tp="subgraph:2", heads=4,
                             hidden=32, dp=1, pp=1).grid_shape(2)
    model = gw.models.Bert(V, H, HEADS, 1, L, linformer_k=4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(gw.GridError, match="this Linformer projects 16 tokens; the sequence has 8"):
        model(torch.zeros(1, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(gw.GridError, match="mask token 5 must lie outside"):
        gw.data.masked_lm(torch.zeros(1, 4, dtype=torch.int64), [0], 0, 5, 10)


# ---- the main job --------------------------------------------------------------------------

def _train(tmp, name, n, extra, port):
    out = tmp / name
    cmd = [sys.executable, "-m", "gridweave.cli", "train", *launcher_args(), "--nproc", str(n), "--model", "bert",
           "--hidden", "32", "--heads", "4", "--layers", "4", "--seq", "32", "--batch", "8", "--microbatches", "2",
           "--steps", "3", "--val-every", "3", "--val-samples", "8", "--tokenizer", "bytes", "--warmup", "1",
           "--quiet", "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1", GRIDWEAVE_PORT=str(port)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    m = json.loads((out / "metrics.json").read_text())
    return m["loss"] + [v for _, v in m["val_loss"]]


@pytest.mark.parametrize("extra,grid", [
    ([], ["--tp", "row:2", "--tp-sp", "--sp", "2", "--pp", "2", "--dp", "1"]),
    (["--attention", "linformer", "--linformer-k", "8"], ["--tp", "row:2", "--sp", "2", "--dp", "2", "--pp", "1"])])
def test_the_main_job_trains_bert_with_one_process_losses(tmp_path, extra, grid):
    """BERT's masked LM (and Linformer) trained over tp x sp x pp / tp x sp x dp gives one process's
    training and validation losses (float32, 1e-5): the masks, the loss over the global batch's
    predicted tokens and the optimizer agree whatever the grid."""
    one = _train(tmp_path, "one", 1, extra + ["--dp", "1", "--pp", "1"], 29721)
    many = _train(tmp_path, "grid", 8, extra + grid, 29725)
    assert max(abs(a - b) / abs(a) for a, b in zip(one, many)) < 1e-5, (one, many)
