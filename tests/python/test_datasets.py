"""--data beyond text files: JSON Lines, Parquet and Arrow records through the `datasets` library
(a record a document, ending with the tokenizer's end-of-sequence token), nanoGPT's
pre-tokenized .bin files, tokenization that streams (memory independent of the corpus size), the
reader resuming exactly on them, and their bad input as one error before anything starts. The
reference token ids are the `tokenizers` library's own encoding of each record."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rankpool import launcher_args

import gridweave as gw

datasets = pytest.importorskip("datasets")
from tokenizers import Tokenizer  # noqa: E402

N_RECORDS = 600


def _records():
    """Fortunes as records (one per fortune), with a second field beside the text."""
    text = "".join(gw.data.read_text(None))
    docs = [d.strip("\n") for d in text.split("\n%\n") if d.strip()]
    return [{"id": i, "content": d} for i, d in enumerate(docs[:N_RECORDS])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same records as JSON Lines, Parquet, and a save_to_disk folder (Arrow), and a trained
    BPE tokenizer (with its end-of-text token)."""
    root = tmp_path_factory.mktemp("corpus")
    recs = _records()
    (root / "jsonl").mkdir()
    with open(root / "jsonl" / "part-0.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs[:N_RECORDS // 2])
    with open(root / "jsonl" / "part-1.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs[N_RECORDS // 2:])
    ds = datasets.Dataset.from_list(recs)
    ds.to_parquet(str(root / "records.parquet"))
    ds.save_to_disk(str(root / "arrow"))
    gw.data.prepare(root / "tok", None, "bpe", 512, tokenize=False)
    return root, recs


def _reference_ids(recs, tok_path):
    """Each record encoded by `tokenizers` itself, its end-of-text id after it; the document starts."""
    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id(gw.data.EOT)
    ids, starts = [], []
    for r in recs:
        starts.append(len(ids))
        ids += tok.encode(r["content"]).ids + [eot]
    return np.asarray(ids, dtype=np.uint16), np.asarray(starts, dtype=np.int64)


@pytest.mark.parametrize("where", ["jsonl", "records.parquet", "arrow"])
def test_records_tokenize_to_each_record_and_its_end_of_text(corpus, tmp_path, where):
    root, recs = corpus
    src = gw.data.source(str(root / where), text_field="content")
    assert src.format is {"jsonl": gw.data.Format.JSON, "records.parquet": gw.data.Format.PARQUET,
                          "arrow": gw.data.Format.ARROW}[where]
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(cache.rglob("*")) if cache.exists() else []
    gw.data.prepare(tmp_path, src, tokenizer_from=str(root / "tok" / "tokenizer.json"))
    ids, starts = _reference_ids(recs, root / "tok" / "tokenizer.json")
    tokens = gw.data.open_tokens(tmp_path)
    np.testing.assert_array_equal(np.concatenate([tokens.train, tokens.val]), ids)
    np.testing.assert_array_equal(tokens.documents, starts)
    assert len(tokens.train) == int(len(ids) * 0.95)
    after = sorted(cache.rglob("*")) if cache.exists() else []
    assert not [p for p in after if p not in before and p.suffix != ".lock"], "datasets wrote data into its cache"


def test_nanogpt_token_files_are_read_in_place(corpus, tmp_path):
    """train.bin / val.bin (uint16) and one uint32 .bin: memory-mapped where they are, the
    documents found after each end-of-text id, an id outside the tokenizer one error."""
    root, recs = corpus
    ids, starts = _reference_ids(recs, root / "tok" / "tokenizer.json")
    split = len(ids) - 4000
    folder = tmp_path / "owt"
    folder.mkdir()
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    tok = str(root / "tok" / "tokenizer.json")
    gw.data.prepare(tmp_path / "a", gw.data.source(str(folder), token_dtype="uint16"), tokenizer_from=tok)
    t = gw.data.open_tokens(tmp_path / "a")
    np.testing.assert_array_equal(t.train, ids[:split])
    np.testing.assert_array_equal(t.val, ids[split:])
    np.testing.assert_array_equal(t.documents, starts[starts < split])
    assert t.train.filename == str((folder / "train.bin").resolve()) and not (tmp_path / "a" / "tokens.bin").exists()

    one = tmp_path / "all.bin"
    ids.astype(np.uint32).tofile(one)
    gw.data.prepare(tmp_path / "b", gw.data.source(str(one), token_dtype="uint32"), tokenizer_from=tok)
    t = gw.data.open_tokens(tmp_path / "b")
    np.testing.assert_array_equal(np.concatenate([t.train, t.val]), ids)

    bad = tmp_path / "bad.bin"
    np.asarray([1, 2, 900], dtype=np.uint16).tofile(bad)
    with pytest.raises(gw.GridError, match="holds token id 900, outside the tokenizer's 512 tokens"):
        gw.data.prepare(tmp_path / "c", gw.data.source(str(bad), token_dtype="uint16"), tokenizer_from=tok)
    with pytest.raises(gw.GridError, match="is pre-tokenized: give its dtype"):
        gw.data.source(str(folder))
    with pytest.raises(gw.GridError, match="is pre-tokenized: give the tokenizer"):
        gw.data.prepare(tmp_path / "d", gw.data.source(str(folder), token_dtype="uint16"))


PEAK = """
import json, resource, sys
import gridweave as gw
src = gw.data.source(sys.argv[1])
gw.data.load_tokenizer(sys.argv[2] + "/tokenizer.json").encode("warm up")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
gw.data.prepare(sys.argv[3], src, tokenizer_from=sys.argv[2] + "/tokenizer.json")
print(json.dumps({"growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base}))
"""


def test_tokenization_streams_in_bounded_memory(corpus, tmp_path):
    """A corpus 4x larger costs no more memory to tokenize: records go through in chunks and the
    ids to disk (holding the corpus, its ids or a list of them would grow by tens of MiB)."""
    root, recs = corpus
    growth = {}
    for copies in (4, 16):
        path = tmp_path / f"x{copies}.jsonl"
        with open(path, "w") as f:
            for _ in range(copies):
                f.writelines(json.dumps({"text": r["content"]}) + "\n" for r in recs)
        r = subprocess.run([sys.executable, "-c", PEAK, str(path), str(root / "tok"), str(tmp_path / f"o{copies}")],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
        growth[copies] = json.loads(r.stdout.strip().splitlines()[-1])["growth_kib"]
        size = path.stat().st_size
    count = json.loads((tmp_path / "o16" / "tokens.json").read_text())["count"]
    assert count == 4 * json.loads((tmp_path / "o4" / "tokens.json").read_text())["count"]
    # 12 more copies: ~3/4 of a 16-copy corpus of `size` bytes and 8 bytes per id held as numpy int64
    assert growth[16] - growth[4] < 0.25 * (0.75 * size + 6 * count) / 1024, (growth, size, count)


ARGS = ["--steps", "4", "--hidden", "32", "--layers", "2", "--heads", "4", "--seq", "32", "--batch", "8",
        "--warmup", "2", "--val-every", "2", "--val-samples", "8", "--sample-tokens", "0", "--quiet", "--log", "none"]


def _train(out, *extra, nproc=2, port=29731):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRIDWEAVE_PORT": str(port)}
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, "--out", str(out), "--nproc", str(nproc),
                        *launcher_args(), *extra], capture_output=True, text=True, timeout=300, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    m = json.loads((Path(out) / "metrics.json").read_text())
    return m["loss"], m["val_loss"]


def test_the_main_job_trains_on_records_and_token_files_alike_and_resumes_exactly(corpus, tmp_path):
    """Parquet records with --text-field and the same ids as nanoGPT's train.bin / val.bin give one
    run's losses; a run stopped at step 2 on one process and resumed on two continues them."""
    root, recs = corpus
    tok = str(root / "tok")
    losses, val = _train(tmp_path / "parquet", "--data", str(root / "records.parquet"), "--text-field", "content",
                         "--tokenizer", tok)
    ids = np.concatenate([gw.data.open_tokens(tmp_path / "parquet").train, gw.data.open_tokens(tmp_path / "parquet").val])
    split = int(len(ids) * 0.95)
    (tmp_path / "bin").mkdir()
    ids[:split].tofile(tmp_path / "bin" / "train.bin")
    ids[split:].tofile(tmp_path / "bin" / "val.bin")
    b_losses, b_val = _train(tmp_path / "bin-run", "--data", str(tmp_path / "bin"), "--token-dtype", "uint16",
                             "--tokenizer", tok, port=29733)
    assert b_losses == losses and b_val == val
    first, _ = _train(tmp_path / "first", "--data", str(root / "records.parquet"), "--text-field", "content",
                      "--tokenizer", tok, "--steps", "2", nproc=1, port=29735)
    later, later_val = _train(tmp_path / "later", "--data", str(root / "records.parquet"), "--text-field", "content",
                              "--tokenizer", tok, "--resume", str(tmp_path / "first"), port=29737)
    assert np.allclose(later, losses, rtol=1e-5, atol=0) and np.allclose(later_val, val, rtol=1e-5, atol=0)
    assert np.allclose(first, losses[:2], rtol=1e-5, atol=0)


def _refused(tmp_path, *extra):
    r = subprocess.run([sys.executable, "-m", "gridweave.cli", "train", *ARGS, "--nproc", "2",
                        "--out", str(tmp_path / "run"), *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()
    return r.stderr


def test_bad_data_is_one_error_before_anything_starts(corpus, tmp_path):
    root, _ = corpus
    err = _refused(tmp_path, "--data", str(root / "jsonl"))
    assert "record 0 has no field 'text' (its fields: content, id); choose the text with --text-field" in err, err
    err = _refused(tmp_path, "--data", str(root / "records.parquet"), "--text-field", "id")
    assert "record 0's field 'id' is int, not text" in err, err
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    assert "3 bytes is not a file of uint16 tokens" in _refused(tmp_path, "--data", str(tmp_path / "t.bin"),
                                                                 "--token-dtype", "uint16", "--tokenizer", "bytes")
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "whole.bin")
    assert "is pre-tokenized: give the tokenizer" in _refused(tmp_path, "--data", str(tmp_path / "whole.bin"),
                                                              "--token-dtype", "uint16")
