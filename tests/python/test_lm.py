"""The language-model pieces of the main job against independent references: Megatron's
vocab-parallel embedding, head and loss in 1-D mode (the dense model's loss and gradients;
3 values per token on the tensor axis), the data reader (each dp rank its own rows of the
global batch; exact resume), the BPE tokenizer, sampling with a key/value cache (the full
forward; Hugging Face's greedy generate), and the exported run in transformers."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tp_refs import DEVICE, rel

import gridweave as gw


def _vocab_parallel(ctx, tie):
    n = ctx.world_size
    grid = ctx.init(tp=gw.Row(n))
    torch.manual_seed(0)
    dense = gw.models.Llama(64, 32, 4, 2, 16, kv_heads=min(n, 4), ffn_hidden=40, tie=tie, dtype=torch.float64, device=DEVICE)
    stage = gw.models.GPTStage(dense, grid, None, 0, 1)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    tgt = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2), device="cpu").to(DEVICE)
    ref = dense.loss(dense(ids), tgt)
    ref.backward()
    logits = stage(ids)
    assert logits.shape[-1] == 64 // n  # the head's output stays split over the vocabulary
    grid.reset_stats()
    loss = stage.loss(logits, tgt)
    loss_stats = grid.stats()
    loss.backward()
    gw.reduce_gradients(stage, grid)
    errs = {"loss": rel(loss, ref)}
    grads = stage.dense_state(True)
    for k, p in dense.named_parameters(remove_duplicate=False):
        errs[k] = rel(grads[k], p.grad)
    tp = loss_stats["tp"]
    return errs, tp["sent_intra"]["bytes"] + tp["sent_inter"]["bytes"], tp["ops"]


@pytest.mark.parametrize("n,tie", [(2, False), (4, True)])
def test_vocab_parallel_head_and_loss_equal_the_dense_model(pool, n, tie):
    tokens = 4 * 16
    for errs, sent, ops in pool.run(_vocab_parallel, n, tie):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        # Megatron-LM: the max, then (sum of exponentials, target logit): 3 float64 per token,
        # each an all-reduce of 2 (n-1)/n of its bytes, never the b x s x v logits
        assert ops == 2
        assert sent == 2 * (n - 1) * (3 * tokens * 8) // n, sent


def test_reader_gives_each_dp_rank_its_rows_and_resumes_exactly(tmp_path):
    gw.data.prepare(tmp_path, None, "bytes", 256)
    tokens = gw.data.open_tokens(tmp_path)
    whole = gw.data.Reader(tokens.train, 16, 8, seed=3)
    batches = [whole.next() for _ in range(3)]
    for step, (x, y) in enumerate(batches):
        assert torch.equal(x[:, 1:], y[:, :-1])
        parts = []
        for r in range(4):
            rd = gw.data.Reader(tokens.train, 16, 8, seed=3, dp_rank=r, dp=4, position=8 * step)
            parts.append(rd.next()[0])
        assert torch.equal(torch.cat(parts), x)  # the dp ranks' rows are the global batch, in order
        # in micro-batches: each micro-batch of the global batch is its ranks' rows of it, in order
        parts = [gw.data.Reader(tokens.train, 16, 8, seed=3, dp_rank=r, dp=2, position=8 * step,
                                microbatches=2).next()[0] for r in range(2)]
        assert torch.equal(torch.cat([parts[0][:2], parts[1][:2], parts[0][2:], parts[1][2:]]), x)
    resumed = gw.data.Reader(tokens.train, 16, 8, seed=3)
    resumed.load_state_dict({**whole.state_dict(), "position": 16})
    assert torch.equal(resumed.next()[0], batches[2][0])
    # windows are whole, non-overlapping slices of the training split, none from validation
    w = batches[0][0][0].numpy()
    start = [i for i in range(0, len(tokens.train) - 16, 16) if (tokens.train[i:i + 16] == w).all()]
    assert start and start[0] % 16 == 0


def test_bpe_tokenizer_round_trips_and_compresses(tmp_path):
    gw.data.prepare(tmp_path, None, "bpe", 512)
    tok = gw.data.load_tokenizer(tmp_path / "tokenizer.json")
    meta = json.loads((tmp_path / "tokens.json").read_text())
    assert tok.vocab_size == 512 and meta["tokenizer"] == "bpe"
    text = "The quick brown fox -- jumps over the lazy dog. Ünïcödé ☃"
    assert tok.decode(tok.encode(text)) == text
    assert meta["count"] < 0.6 * gw.data.source(None).size()  # 512 BPE tokens: about 1.9 bytes per token here
    mtime = (tmp_path / "tokens.bin").stat().st_mtime_ns
    gw.data.prepare(tmp_path, None, "bpe", 512)  # the same files and tokenizer: kept, not redone
    assert (tmp_path / "tokens.bin").stat().st_mtime_ns == mtime
    tokens = gw.data.open_tokens(tmp_path)
    assert int(tokens.train.max()) < 512 and int(tokens.val.max()) < 512


def test_a_corpus_that_is_not_text_is_a_clear_error(tmp_path):
    bad = tmp_path / "blob.txt"
    bad.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(gw.GridError, match="is not text"):
        gw.data.prepare(tmp_path / "out", str(bad), "bpe", 512)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 400)
    with pytest.raises(gw.GridError, match="not UTF-8"):
        gw.data.prepare(tmp_path / "out2", str(latin), "bpe", 512)


def test_kv_cache_logits_equal_the_full_forward():
    from gridweave.generate import KVCache, forward_cached

    torch.manual_seed(0)
    deepseek = gw.models.ModelConfig("llama", 50, 32, 4, 2, 24, 40, dense_layers=(0,),  # latent attention's cache
                                     mla=gw.nn.MLA(kv_rank=12, q_rank=16, nope=6, rope=4, v=10),
                                     moe=gw.nn.MoE(experts=4, top_k=2, ffn=8, scoring="sigmoid", expert_bias=True))
    for model in (gw.models.Llama(50, 32, 4, 2, 24, kv_heads=2, ffn_hidden=40, dtype=torch.float64, device="cpu"),
                  gw.models.GPT(50, 32, 4, 2, 24, dtype=torch.float64, device="cpu"),
                  gw.models.build(deepseek, dtype=torch.float64, device="cpu")):
        ids = torch.randint(0, 50, (2, 20), device="cpu")
        full = model(ids)
        cache = KVCache(2)
        parts = [forward_cached(model, ids[:, :7], cache), forward_cached(model, ids[:, 7:8], cache),
                 forward_cached(model, ids[:, 8:], cache)]
        assert rel(torch.cat(parts, dim=1), full) < 1e-12


def test_greedy_sampling_equals_transformers_generate():
    tf = pytest.importorskip("transformers")
    from gridweave.generate import sample

    torch.manual_seed(0)
    c = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device("cpu"):  # transformers builds on torch's default device
        hf = tf.LlamaForCausalLM(c).double().eval()
    ours = gw.models.from_hf(hf)
    prompt = [3, 14, 15, 9, 2, 6]
    with torch.device("cpu"):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0].tolist()
    assert sample(ours, prompt, 16, temperature=0.0) == want


def test_sampling_options_and_bad_prompts():
    from gridweave.generate import sample

    torch.manual_seed(0)
    m = gw.models.Llama(40, 16, 2, 1, 12, dtype=torch.float64, device="cpu")
    a = sample(m, [1, 2], 8, temperature=1.0, top_k=1, seed=1)
    assert a == sample(m, [1, 2], 8, temperature=0.0)  # top-1 sampling is greedy
    assert sample(m, [1, 2], 8, 0.9, 5, seed=2) == sample(m, [1, 2], 8, 0.9, 5, seed=2)
    assert all(t < 30 for t in sample(m, [1, 2], 8, 2.0, None, seed=3, vocab=30)[2:])  # padding never sampled
    with pytest.raises(gw.GridError, match="context"):
        sample(m, [1] * 10, 8)
    with pytest.raises(gw.GridError, match="no tokens"):
        sample(m, [], 4)


def test_lr_schedule_is_warmup_then_cosine():
    cfg = gw.train.TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    assert cfg.lr_at(0) == pytest.approx(1e-4) and cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(55) == pytest.approx(1e-4 + 0.45e-3)  # half way through the cosine
    assert cfg.lr_at(100) == pytest.approx(1e-4)


def test_model_flops_per_token_counts_the_matrices():
    cfg = gw.models.ModelConfig("llama", 256, 64, 4, 2, 32, 96, 2)
    model = gw.models.build(cfg, device="meta")
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "pos" not in n)
    embed = model.embed.tok.weight.numel()  # a lookup, not a product: counted once, as the head
    assert gw.train.model_flops_per_token(cfg) == 6 * (matrices - embed) + 12 * 2 * 64 * 32
    # latent attention: its down and up projections, the scores over nope + rope dimensions, the values' v
    for q_rank in (24, None):
        mla = gw.nn.MLA(kv_rank=16, q_rank=q_rank, nope=8, rope=4, v=10)
        cfg = gw.models.ModelConfig("llama", 256, 64, 4, 2, 32, 96, mla=mla)
        model = gw.models.build(cfg, device="meta")
        matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
        attention = 6 * 2 * 32 * 4 * (8 + 4 + 10)
        assert gw.train.model_flops_per_token(cfg) == 6 * (matrices - embed) + attention


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A short BPE run in one process: it learns past the unigram entropy."""
    out = tmp_path_factory.mktemp("bpe") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "1", "--steps", "120",
                        "--vocab", "512", "--val-every", "40", "--hidden", "64", "--heads", "4", "--seq", "64",
                        "--batch", "16", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_an_existing_tokenizer_tokenizes_the_corpus(bpe_run, tmp_path):
    """--tokenizer PATH (a tokenizer.json made elsewhere: here the BPE run's, by the folder holding
    it): the run keeps it and its token file is the one that tokenizer gives; a path without one
    is one error before anything starts."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "1", "--steps", "1",
                        "--tokenizer", str(bpe_run), "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "16",
                        "--val-every", "0", "--sample-tokens", "0", "--quiet", "--log", "none", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "tokenizer.json").read_bytes() == (bpe_run / "tokenizer.json").read_bytes()
    assert (out / "tokens.bin").read_bytes() == (bpe_run / "tokens.bin").read_bytes()
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "1", "--tokenizer",
                        str(tmp_path / "nowhere"), "--out", str(tmp_path / "bad")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and "no tokenizer.json there" in r.stderr and not (tmp_path / "bad").exists(), r.stderr


def test_a_short_run_beats_the_unigram_entropy_and_samples(bpe_run):
    m = json.loads((bpe_run / "metrics.json").read_text())
    assert m["val_loss"][-1][1] < m["unigram_entropy_val"] - 0.3, (m["val_loss"], m["unigram_entropy_val"])
    assert [v[0] for v in m["val_loss"]] == [40, 80, 120]
    assert 0 < m["mfu"][-1] < 1 and m["tokens_per_s"][-1] > 0
    assert m["lr"][0] < m["lr"][9] and m["lr"][-1] < m["lr"][20]
    assert m["sample"]["text"].startswith(m["sample"]["prompt"]) and len(m["sample"]["text"]) > len(m["sample"]["prompt"])
    assert (bpe_run / "loss.png").stat().st_size > 0


def test_generate_command_samples_a_checkpoint(bpe_run):
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "generate", "--run", str(bpe_run), "--prompt",
                        "The ", "--tokens", "12", "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("The "), r.stderr[-2000:]


def test_exported_run_gives_the_same_validation_loss_in_transformers(bpe_run, tmp_path):
    tf = pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "export", "--run", str(bpe_run), "--out",
                        str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.device("cpu"):
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = gw.data.open_tokens(bpe_run)
    windows = gw.data.validation_windows(tokens.val, 64, 32)
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    m = json.loads((bpe_run / "metrics.json").read_text())
    assert abs(loss.item() - m["val_loss"][-1][1]) < 1e-4, (loss.item(), m["val_loss"][-1])
    # the special tokens are the run's tokenizer's (issue 33: GPT-2's 50256 outside a small vocabulary)
    from tokenizers import Tokenizer

    eot = Tokenizer.from_file(str(bpe_run / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert eot is not None and hf.config.eos_token_id == eot == hf.config.bos_token_id < hf.config.vocab_size
    assert hf.generation_config.eos_token_id == eot
    # and AutoTokenizer reads the same tokenizer with that token as its bos and eos (tokenizer_config.json)
    tok = tf.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.bos_token_id == tok.eos_token_id == eot
    text = gw.data.read_text(None)[0][:100]
    assert tok(text)["input_ids"] == gw.data.load_tokenizer(bpe_run / "tokenizer.json").encode(text)


def _scatter_gather(ctx):
    grid = ctx.init(tp=gw.Row(2), pp=2)
    torch.manual_seed(0)
    dense = gw.models.Llama(64, 32, 4, 2, 16, kv_heads=2, ffn_hidden=40, dtype=torch.float64, device=DEVICE)
    stage = gw.models.GPTStage(dense, grid, None, grid.coords["pp"], 2)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE)
    tgt = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2), device="cpu").to(DEVICE)
    dense.loss(dense(ids), tgt).backward()
    xs, ys = [ids[:2], ids[2:]], [tgt[:2], tgt[2:]]
    grid.reset_stats()
    gw.pipeline.pipeline_step(stage, grid, xs, ys, stage.loss, stage.activation_shape(2, 16), dtype=torch.float64)
    pp = grid.stats()["pp"]
    gw.reduce_gradients(stage, grid)
    ref = dict(dense.named_parameters())
    errs = {k: rel(g, ref[k].grad) for k, g in stage.dense_state(True).items()}
    return errs, pp["sent_intra"]["bytes"] + pp["sent_inter"]["bytes"], tuple(stage.activation_shape(2, 16))


def test_stage_boundaries_send_one_tensor_rank_share(pool):
    """Megatron's scatter/gather (Megatron-LM Fig. 10): in 1-D mode the boundary activation is the
    same on both tensor ranks, so each sends half and the next stage all-gathers: per rank
    and microbatch b x s x h / t values forward (stage 0) or backward (stage 1)."""
    for errs, sent, shape in pool.run(_scatter_gather, 4):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert shape == (2, 16, 16)
        payload = 2 * (2 * 16 * 32 // 2) * 8  # 2 microbatches of b x s x h / t float64
        assert payload <= sent < payload + 64, sent  # + the schedule's few scalars (the microbatch count)


def test_export_dense_writes_the_model_in_one_process(bpe_run, tmp_path):
    from safetensors.torch import load_file

    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "export", "--run", str(bpe_run), "--out",
                        str(tmp_path / "dense"), "--format", "dense"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = gw.models.ModelConfig.from_dict(json.loads((tmp_path / "dense" / "model_config.json").read_text()))
    model = gw.models.build(cfg, device="cpu")
    model.load_state_dict(load_file(str(tmp_path / "dense" / "model.safetensors")))
    ref, _, _ = gw.train.load_model(bpe_run)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_a_lower_casing_tokenizer_with_unknown_tokens_trains(tmp_path):
    """A tokenizer that does not give the text back (BERT-uncased-style WordPiece: lower-cased,
    accents stripped, an [UNK] for what its vocabulary lacks) tokenizes the corpus: the documents'
    boundaries come from its offsets (each document tokenized alone gives the same starts), the
    unknown tokens are said once with their share, and the main job trains on it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = "the quick brown fox jumps over a lazy dog while the cat sleeps in warm sun".split()
    tok.train_from_iterator([" ".join(words)] * 50, trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    docs = ["The Quick brown FOX jumps.\n", "A lazy dog sleeps ☃ in the SUN.\n", "Over the cat, while ☃☃ warm.\n"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("%\n".join(docs * 40))
    said = []
    out = gw.data.prepare(tmp_path / "data", str(corpus), tokenizer_from=str(folder / "tokenizer.json"),
                          say=said.append, warn=said.append)
    tokens = gw.data.open_tokens(out)
    pieces = [tok.encode(d + "%\n" if i < 119 else d).ids for i, d in enumerate(docs * 40)]
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert tokens.documents.tolist() == starts
    unknown = sum(p.count(tok.token_to_id("[UNK]")) for p in pieces)
    assert unknown > 0 and sum("unknown token '[UNK]'" in line for line in said) == 1
    assert f"{unknown:,} of {sum(map(len, pieces)):,} tokens" in next(x for x in said if "[UNK]" in x)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", "--nproc", "1", "--steps", "2", "--data",
                        str(corpus), "--tokenizer", str(folder), "--hidden", "32", "--heads", "4", "--seq", "16",
                        "--batch", "8", "--val-every", "0", "--sample-tokens", "0", "--log", "none", "--out",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("unknown token '[UNK]'") == 1, r.stdout
