"""Fine-tuning from Hugging Face: --init-from a local Llama or GPT-2 folder (config, safetensors,
tokenizer with its special tokens and chat template, generation config) into a grid, its first
loss transformers' own on the same batch; `gridweave export` writes back everything the import
read, so export -> import -> export is the identity on config, weights and tokenizer files.
The references are transformers' models and files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rankpool import launcher_args

import gridweave as gw

tf = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

VOCAB = 384  # a multiple of 64: it splits over 2 vocabulary shards
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _tokenizer(special):
    """A byte-level BPE trained on the corpus by `tokenizers`, with these special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 40, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(gw.data.read_text(None)[:20], trainer)
    return tok


def _folder(root, family):
    """A Hugging Face folder as transformers saves one: Llama with <s> </s> <pad> and a chat template,
    or GPT-2 with its end-of-text token (tied embeddings, 128 positions)."""
    torch.manual_seed(7)
    folder = root / family
    with torch.device("cpu"):
        if family == "llama":
            tok = tf.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(["<s>", "</s>", "<pad>"]), bos_token="<s>",
                                             eos_token="</s>", pad_token="<pad>")
            tok.chat_template = CHAT
            config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=2, rms_norm_eps=1e-5,
                                    initializer_range=0.1)
            model = tf.LlamaForCausalLM(config)
            gen = tf.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=True, temperature=0.7,
                                      top_k=11, max_new_tokens=7)
        else:
            tok = tf.PreTrainedTokenizerFast(tokenizer_object=_tokenizer([gw.data.EOT]), bos_token=gw.data.EOT,
                                             eos_token=gw.data.EOT)
            config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   initializer_range=0.1)
            model = tf.GPT2LMHeadModel(config)
            gen = tf.GenerationConfig(bos_token_id=0, eos_token_id=0, repetition_penalty=1.3)
        model.save_pretrained(str(folder))
        gen.save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: _folder(root, f) for f in ("llama", "gpt2")}


def _hf_model(folder, dtype=torch.float32):
    with torch.device("cpu"):
        return tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_from_pretrained_gives_transformers_logits(hf_folders, family):
    folder = hf_folders[family]
    ours = gw.hf.from_pretrained(folder, dtype=torch.float64)
    theirs = _hf_model(folder, torch.float64)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator(device="cpu").manual_seed(1), device="cpu")
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    # transformers computes Llama's RMSNorm and rotary angles in float32 whatever the dtype (test_hf)
    assert diff < (1e-6 if family == "llama" else 1e-10), diff
    tok = gw.data.load_tokenizer(folder / "tokenizer.json")  # its special tokens from tokenizer_config.json
    want = {"llama": {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2},
            "gpt2": {"bos_token_id": 0, "eos_token_id": 0}}[family]
    assert tok.special_ids() == want


ARGS = ["--seq", "32", "--batch", "8", "--microbatches", "2", "--val-every", "2", "--val-samples", "8",
        "--sample-tokens", "4", "--quiet", "--log", "none", "--warmup", "1"]


def _run(*args, port=29751, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", *args], capture_output=True, text=True, timeout=300,
                       env=env, stdin=subprocess.DEVNULL)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def _train(out, folder, *extra, port=29751):
    _run("train", *ARGS, "--init-from", str(folder), "--out", str(out), *launcher_args(), *extra, port=port)
    return json.loads((Path(out) / "metrics.json").read_text())


def _tensors(folder):
    return load_file(str(Path(folder) / "model.safetensors"), device="cpu")


def _config(folder, name="config.json"):
    d = json.loads((Path(folder) / name).read_text())
    d.pop("transformers_version", None)
    return d


@pytest.mark.parametrize("family,grid,port", [("llama", ("--nproc", "4", "--tp", "row:2", "--pp", "2"), 29753),
                                              ("gpt2", ("--nproc", "4", "--sp", "2", "--dp", "2"), 29757)])
def test_init_from_continues_the_model_and_export_writes_back_what_it_read(hf_folders, tmp_path, family, grid, port):
    folder = hf_folders[family]
    m = _train(tmp_path / "run", folder, "--steps", "2", *grid, port=port)
    # the first step's loss: transformers' on the reader's first global batch (the weights before any update)
    tokens = gw.data.open_tokens(tmp_path / "run")
    x, y = gw.data.Reader(tokens.train, 32, 8, seed=0).next()
    with torch.no_grad():
        logits = _hf_model(folder)(x).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    assert abs(m["loss"][0] - ref) < 1e-5 * ref, (m["loss"][0], ref)
    assert len(m["loss"]) == 2 and all(np.isfinite(m["loss"]))
    # the tokens are the imported tokenizer's (a record's ids are transformers' encoding)
    hf_tok = tf.AutoTokenizer.from_pretrained(str(folder))
    text = gw.data.read_text(None)[0][:200]
    assert gw.data.load_tokenizer(tmp_path / "run" / "tokenizer.json").encode(text) == hf_tok(text)["input_ids"]

    _run("export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "b"))
    b = tmp_path / "b"
    assert _config(b) == _config(folder)
    assert _config(b, "generation_config.json") == _config(folder, "generation_config.json")
    for name in TOKENIZER_FILES:
        assert (b / name).exists() == (folder / name).exists(), name
        if (folder / name).exists():
            assert (b / name).read_bytes() == (folder / name).read_bytes(), name
    again = tf.AutoTokenizer.from_pretrained(str(b))
    assert (again.bos_token, again.eos_token, again.pad_token, again.chat_template) == \
        (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token, hf_tok.chat_template)
    dense = gw.train.export_dense(tmp_path / "run")
    exported = gw.hf.from_pretrained(b).state_dict()
    for k, v in dense.items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0)
    # export -> import -> export: the identity (no step: --steps 0 converts)
    _train(tmp_path / "again", b, "--steps", "0", "--nproc", "2", "--tp", "row:2", port=port + 2)
    _run("export", "--run", str(tmp_path / "again"), "--out", str(tmp_path / "c"))
    c = tmp_path / "c"
    for name in ("config.json", "generation_config.json") + TOKENIZER_FILES:
        assert (c / name).exists() == (b / name).exists(), name
        if (b / name).exists():
            assert (c / name).read_bytes() == (b / name).read_bytes(), name
    tb, tc = _tensors(b), _tensors(c)
    assert tb.keys() == tc.keys() and all(torch.equal(tb[k], tc[k]) for k in tb)


def _refused(tmp_path, *extra):
    r = _run("train", *ARGS, "--nproc", "2", "--out", str(tmp_path / "run"), *extra, check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()
    return r.stderr


def test_bad_init_from_is_one_error_before_anything_starts(hf_folders, tmp_path):
    llama = str(hf_folders["llama"])
    big = tmp_path / "big"
    gw.data.prepare(big, None, "bpe", 512, tokenize=False)
    assert "has 512 tokens, the model of --init-from" in _refused(tmp_path, "--init-from", llama, "--tokenizer", str(big))
    assert "sets the model: its hidden is 64, this run asks 96" in _refused(tmp_path, "--init-from", llama,
                                                                             "--hidden", "96")
    assert "does not split over tp row:5" in _refused(tmp_path, "--init-from", llama, "--tp", "row:5", "--nproc", "5")
    assert "exceeds init_from's 128 positions" in _refused(tmp_path, "--init-from", llama, "--seq", "256")
    assert "is not a Hugging Face model folder" in _refused(tmp_path, "--init-from", str(tmp_path))
    bert = tmp_path / "bert"
    tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128).save_pretrained(str(bert))
    assert "a bert model; this reads llama, gpt" in _refused(tmp_path, "--init-from", str(bert))
