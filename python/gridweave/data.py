"""Text data for the main job: a corpus (Debian's `fortunes` by default, or any text file or
folder given with --data; JSON Lines, Parquet or Arrow records read through the `datasets`
library; or nanoGPT's pre-tokenized .bin files), a tokenizer (byte-level BPE trained on the
corpus with the `tokenizers` library, raw bytes, or an existing tokenizer.json), the corpus
tokenized once, streaming, into a memory-mapped token file with a train / validation split, and
a reader that gives each data-parallel rank only its own samples and whose position is saved in
checkpoints.

Samples are the non-overlapping windows of seq + 1 tokens of the training split, visited in
a fresh permutation every epoch (seeded): sample k of the run is fixed by (seed, k), so a
resumed run whose reader starts at the saved position sees exactly the batches an
uninterrupted one would, on any grid.
"""
from __future__ import annotations

import enum
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import TMP_MARK, atomic_write
from .errors import GridError
from .models.dense import IGNORE

DEFAULT_CORPUS = "/usr/share/games/fortunes"
TOKENIZER_FILE = "tokenizer.json"
TOKENS_FILE = "tokens.bin"
TOKENS_META = "tokens.json"
DOCUMENTS_FILE = "documents.bin"  # int64: the token index at which each document starts
TOKENS_FORMAT = 2  # 2: with documents.bin
EOT = "<|endoftext|>"


def corpus_files(path: str | None = None) -> list:
    """The text files under `path` (default: the fortunes corpus), sorted."""
    root = Path(path or DEFAULT_CORPUS)
    if not root.exists():
        raise GridError(f"no text corpus at {root}: install Debian's 'fortunes' package (scripts/setup.sh "
                        "does) or give data= a text file or folder")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and not p.name.endswith((".dat", ".u8")) and not p.is_symlink())
    if not files:
        raise GridError(f"no files under {root}")
    return files


def text_of(f: Path) -> str:
    """One corpus file's text; a file that is not UTF-8 text is an error naming it."""
    raw = f.read_bytes()
    if b"\x00" in raw:
        raise GridError(f"{f} is not text (it holds NUL bytes); data takes text files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GridError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}); the tokenizer reads UTF-8") from None


def read_text(path: str | None = None) -> list:
    """Each corpus file's text (text_of)."""
    out = [text_of(f) for f in corpus_files(path)]
    total = sum(len(t) for t in out)
    if total < 1024:
        raise GridError(f"the corpus at {path or DEFAULT_CORPUS} holds only {total} characters")
    return out


class Format(enum.Enum):
    """What --data holds."""
    TEXT = "text"  # UTF-8 text files: documents split at "%" lines (fortunes) or the end-of-text marker
    JSON = "json"  # records (JSON Lines), one document each, read through `datasets`
    PARQUET = "parquet"
    ARROW = "arrow"  # Arrow stream files (what Dataset.save_to_disk writes)
    TOKENS = "tokens"  # token ids already made (nanoGPT's flat uint16 / uint32 .bin files)

    @property
    def records(self) -> bool:
        return self in (Format.JSON, Format.PARQUET, Format.ARROW)


SUFFIXES = {".jsonl": Format.JSON, ".json": Format.JSON, ".parquet": Format.PARQUET, ".arrow": Format.ARROW,
            ".bin": Format.TOKENS}
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class Source:
    """The corpus a run reads: its format and files (TOKENS: train.bin and, if there is one,
    val.bin; or one .bin split like text), the records' text field, the token files' dtype."""
    path: str
    format: Format
    files: tuple
    text_field: str = "text"
    token_dtype: str | None = None

    def records(self):
        """The records' texts, streamed by `datasets` from the local files (no cache is written,
        nothing is fetched); a record without the text field, or whose field is not text, is an
        error naming it."""
        import datasets

        with torch.device("cpu"):  # datasets makes a torch tensor (its epoch counter) on the default device
            stream = datasets.load_dataset(self.format.value, data_files=[str(f) for f in self.files], split="train",
                                           streaming=True)
        for i, row in enumerate(stream):
            if self.text_field not in row:
                raise GridError(f"data={self.path}: record {i} has no field {self.text_field!r} (its fields: "
                                f"{', '.join(sorted(row))}); choose the text with --text-field")
            text = row[self.text_field]
            if not isinstance(text, str):
                raise GridError(f"data={self.path}: record {i}'s field {self.text_field!r} is "
                                f"{type(text).__name__}, not text")
            yield text

    def check(self) -> None:
        """What the launcher checks before any rank starts: the first record has the text field;
        a token file is whole tokens of its dtype."""
        if self.format.records:
            if next(self.records(), None) is None:
                raise GridError(f"data={self.path}: no records")
        elif self.format is Format.TOKENS:
            size = np.dtype(self.token_dtype).itemsize
            for f in self.files:
                if f.stat().st_size % size or f.stat().st_size < 2 * size:
                    raise GridError(f"data={f}: {f.stat().st_size} bytes is not a file of {self.token_dtype} tokens")

    def size(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)


def source(path: str | None = None, text_field: str = "text", token_dtype: str | None = None) -> Source:
    """The Source of --data `path` (default: the fortunes corpus): a file by its suffix; a folder
    holding train.bin is nanoGPT's layout, one holding .arrow or .parquet files (beside
    save_to_disk's JSON metadata) or only .json / .jsonl files is those records, any other
    folder text files."""
    root = Path(path or DEFAULT_CORPUS)
    if root.is_dir() and (root / "train.bin").is_file():
        fmt, files = Format.TOKENS, tuple(root / n for n in ("train.bin", "val.bin") if (root / n).is_file())
    elif root.is_file() and root.suffix in SUFFIXES:
        fmt, files = SUFFIXES[root.suffix], (root,)
    elif root.is_dir():
        found = {}
        for f in sorted(root.rglob("*")):
            if f.is_file() and SUFFIXES.get(f.suffix, Format.TEXT).records:
                found.setdefault(SUFFIXES[f.suffix], []).append(f)
        columnar = [fmt for fmt in (Format.PARQUET, Format.ARROW) if fmt in found]
        if len(columnar) > 1:
            raise GridError(f"data={root} holds both Parquet and Arrow files: give one folder per format")
        fmt = columnar[0] if columnar else (Format.JSON if Format.JSON in found else Format.TEXT)
        files = tuple(found[fmt]) if fmt.records else tuple(corpus_files(path))
    else:
        fmt, files = Format.TEXT, tuple(corpus_files(path))
    if (fmt is Format.TOKENS) != (token_dtype is not None):
        raise GridError(f"data={root} is pre-tokenized: give its dtype (token_dtype {' or '.join(TOKEN_DTYPES)})"
                        if fmt is Format.TOKENS else
                        f"token_dtype={token_dtype} is for pre-tokenized .bin files; data={root} is {fmt.value}")
    if token_dtype is not None and token_dtype not in TOKEN_DTYPES:
        raise GridError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    return Source(str(root), fmt, files, text_field, token_dtype)


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All text files under `path` as uint8 byte tokens (host memory)."""
    data = "".join(read_text(path)).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


# ---- tokenizers ------------------------------------------------------------------------

class ByteTokenizer:
    """Raw UTF-8 bytes: 256 tokens."""
    kind = "bytes"
    unknown = (None, None)  # every text has its bytes

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def special_ids(self) -> dict:
        """Hugging Face's special token ids this tokenizer has: none."""
        return {}

    def token_starts(self, text: str, char_starts: list) -> list:
        """The index of the first token of each character offset of `text` (a byte a token)."""
        out, pos, prev = [], 0, 0
        for c in char_starts:  # in order: each piece's bytes counted once
            pos, prev = pos + len(text[prev:c].encode("utf-8")), c
            out.append(pos)
        return out

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"gridweave_tokenizer": "bytes"}))


class BPETokenizer:
    """Byte-level BPE (GPT-2's scheme) from the `tokenizers` library: any UTF-8 text encodes."""
    kind = "bpe"

    def __init__(self, tok, special: dict | None = None):
        self.tok = tok
        self.special = special or {}  # bos / eos / pad: their tokens' text (tokenizer_config.json)

    @classmethod
    def train(cls, texts, vocab_size: int) -> "BPETokenizer":
        """Trained on `texts` (any iterable of strings: records stream through)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise GridError(f"a BPE vocabulary needs more than the 256 byte tokens, got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def unknown(self) -> tuple:
        """(the unknown token's text, its id), or (None, None) for a model that has none (byte-level BPE)."""
        name = getattr(self.tok.model, "unk_token", None)
        i = self.tok.token_to_id(name) if name else None
        return (name, i) if i is not None else (None, None)

    def encode(self, text: str) -> list:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def special_ids(self) -> dict:
        """Hugging Face's special token ids: those its tokenizer_config.json names (a Llama's <s>,
        </s>), else the end-of-text token opening and ending a text (GPT-2's convention); none for
        a tokenizer without either."""
        if self.special:
            ids = {f"{k}_id": self.tok.token_to_id(v) for k, v in self.special.items()}
            return {k: v for k, v in ids.items() if v is not None}
        eot = self.tok.token_to_id(EOT)
        return {} if eot is None else {"bos_token_id": eot, "eos_token_id": eot}

    def save_hf(self, folder: Path) -> None:
        """tokenizer.json with Hugging Face's tokenizer_config.json naming its special tokens (what
        AutoTokenizer loads), written by transformers."""
        from transformers import PreTrainedTokenizerFast

        names = {k[:-3]: self.tok.id_to_token(v) for k, v in self.special_ids().items()}
        PreTrainedTokenizerFast(tokenizer_object=self.tok, **names).save_pretrained(str(folder))

    def token_starts(self, text: str, char_starts: list) -> list:
        """The index of the first token whose text starts at or after each character offset
        (a token belongs to the document holding its first character)."""
        offsets = [o[0] for o in self.tok.encode(text).offsets]
        return np.searchsorted(np.asarray(offsets, dtype=np.int64), np.asarray(char_starts, dtype=np.int64)).tolist()

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


# Hugging Face's files beside a tokenizer.json that say what its special tokens are (and how a
# chat is written): kept with it wherever a run copies its tokenizer.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SPECIAL = ("bos_token", "eos_token", "pad_token")


def _special_tokens(folder: Path) -> dict:
    """bos / eos / pad token texts from tokenizer_config.json (else special_tokens_map.json)."""
    out = {}
    for name in reversed(TOKENIZER_FILES[:2]):  # tokenizer_config.json wins
        f = folder / name
        if f.is_file():
            d = json.loads(f.read_text())
            for k in SPECIAL:
                v = d.get(k)
                v = v.get("content") if isinstance(v, dict) else v  # the older AddedToken form
                if isinstance(v, str):
                    out[k] = v
    return out


def load_tokenizer(path: Path):
    """The tokenizer saved at `path` (tokenizer.json): byte-level or BPE, its special tokens read
    from tokenizer_config.json beside it."""
    path = Path(path)
    if not path.exists():
        raise GridError(f"no tokenizer at {path}")
    head = json.loads(path.read_text())
    if head.get("gridweave_tokenizer") == "bytes":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    return BPETokenizer(Tokenizer.from_file(str(path)), _special_tokens(path.parent))


def copy_tokenizer(src: Path, folder: Path) -> None:
    """tokenizer.json `src` and the Hugging Face files beside it into `folder` (each written whole)."""
    src = Path(src)
    for s, d in [(src, folder / TOKENIZER_FILE)] + [(src.parent / n, folder / n) for n in TOKENIZER_FILES]:
        if s.is_file() and s.resolve() != d.resolve():
            atomic_write(d, lambda t, s=s: t.write_bytes(s.read_bytes()))


def check_encodable(tokenizer, text: str, what: str) -> list:
    """Token ids of `text`; one that tokenizes to nothing is an error saying so. A tokenizer need
    not give the text back (a lower-casing or normalising one does not): documents' boundaries
    come from its offsets, and what it cannot represent is its unknown token (prepare counts it)."""
    ids = tokenizer.encode(text)
    if not ids:
        raise GridError(f"{what} is empty after tokenization")
    return ids


# ---- the token file --------------------------------------------------------------------

def document_offsets(text: str) -> list:
    """Character offsets where the documents of one corpus file start: the file's start, and after
    every separator, a line holding only "%" (the fortune format) or the end-of-text marker."""
    starts, i = [0], 0
    for line in text.splitlines(keepends=True):
        i += len(line)
        if (line.rstrip("\r\n") == "%" or line.rstrip().endswith(EOT)) and i < len(text):
            starts.append(i)  # lines are never empty: the offsets only grow
    return starts


@dataclass(frozen=True)
class Tokens:
    """The corpus as memory-mapped arrays of token ids, training and validation; `documents`:
    the training token index at which each document starts (packed training masks attention
    across them)."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    documents: np.ndarray


def _fingerprint(src: Source, tokenizer_path: Path) -> str:
    h = hashlib.sha256()
    for f in src.files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(tokenizer_path.read_bytes())
    h.update(f"format {TOKENS_FORMAT} {src.format.value} {src.text_field} {src.token_dtype}".encode())
    return h.hexdigest()


CHUNK = 1 << 10  # records (or text files) tokenized at once: memory stays bounded whatever the corpus


def _documents(src: Source, tok, texts):
    """(token ids, document starts within them) of each chunk of the corpus: a text file's
    documents by document_offsets (mapped to tokens by the tokenizer's offsets); a record a
    document, ending with the tokenizer's end-of-sequence token when it has one (nanoGPT's,
    Megatron's --append-eod)."""
    if not src.format.records:
        for f, t in zip(src.files, texts):
            yield check_encodable(tok, t, f"corpus file {f}"), tok.token_starts(t, document_offsets(t))
        return
    eos = tok.special_ids().get("eos_token_id")
    it = iter(texts)
    while chunk := list(itertools.islice(it, CHUNK)):
        ids, starts = [], []
        for t in chunk:
            if not t:
                continue  # an empty record is no document
            starts.append(len(ids))
            ids.extend(check_encodable(tok, t, f"a record of {src.path}"))
            if eos is not None:
                ids.append(eos)
        yield ids, starts


def _write_streaming(folder: Path, dtype, pieces, unknown_id=None) -> tuple:
    """tokens.bin and documents.bin written piece by piece into temporary files, then renamed:
    (token count, document count, how many tokens are unknown_id). A failure leaves neither
    temporary file."""
    tmp = {name: folder / f"{name}{TMP_MARK}{os.getpid()}" for name in (TOKENS_FILE, DOCUMENTS_FILE)}
    count = docs = unknown = 0
    try:
        with open(tmp[TOKENS_FILE], "wb") as t, open(tmp[DOCUMENTS_FILE], "wb") as d:
            for ids, starts in pieces:
                (np.unique(np.asarray(starts, dtype=np.int64)) + count).tofile(d)  # sorted; an empty document drops out
                ids = np.asarray(ids, dtype=dtype)
                ids.tofile(t)
                unknown += int((ids == unknown_id).sum()) if unknown_id is not None else 0
                count, docs = count + len(ids), docs + len(np.unique(starts))
        for name, path in tmp.items():
            os.replace(path, folder / name)
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise
    return count, docs, unknown


def _scan_tokens(src: Source, vocab: int, eos) -> np.ndarray:
    """Pre-tokenized files checked chunk by chunk (every id within the tokenizer's vocabulary);
    the training file's document starts: its first token and each token after an eos."""
    starts = [np.zeros(1, dtype=np.int64)]
    for f in src.files:
        ids = np.memmap(f, dtype=np.dtype(src.token_dtype), mode="r")
        for i in range(0, len(ids), 1 << 24):
            chunk = ids[i:i + (1 << 24)]
            if len(chunk) and int(chunk.max()) >= vocab:
                raise GridError(f"data={f} holds token id {int(chunk.max())}, outside the tokenizer's {vocab} tokens "
                                "(is token_dtype right, and the tokenizer the one its ids come from?)")
            if eos is not None and f == src.files[0]:
                starts.append(np.flatnonzero(chunk == eos).astype(np.int64) + i + 1)
    first = np.unique(np.concatenate(starts))
    return first[first < len(np.memmap(src.files[0], dtype=np.dtype(src.token_dtype), mode="r"))]


def prepare(folder, data: str | Source | None, tokenizer: str = "bpe", vocab_size: int = 1024,
            val_fraction: float = 0.05, tokenizer_from: str | None = None, tokenize: bool = True,
            say=None, warn=None) -> Path:
    """Train (or reuse, from `tokenizer_from`) the tokenizer and tokenize the corpus once into
    `folder`/tokens.bin, streaming (tokenize=False: the tokenizer alone); returns `folder`.
    Pre-tokenized files are not copied: tokens.json points at them. Idempotent: a token file made
    from the same files and tokenizer is kept. say(line): told what is being made, and when it is
    done (the main job prints it); warn(line): told what the tokenizer cannot represent (default:
    printed to stderr)."""
    import sys
    import time

    say = say or (lambda line: None)
    warn = warn or (lambda line: print(f"gridweave: {line}", file=sys.stderr, flush=True))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not 0 < val_fraction < 0.5:
        raise GridError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    src = data if isinstance(data, Source) else source(data)
    tok_path = folder / TOKENIZER_FILE
    if tokenizer_from is not None:
        load_tokenizer(Path(tokenizer_from))  # a clear error if it is not one
        copy_tokenizer(Path(tokenizer_from), folder)
    elif src.format is Format.TOKENS and tokenizer != "bytes":
        raise GridError(f"data={src.path} is pre-tokenized: give the tokenizer its ids come from (tokenizer = a "
                        "tokenizer.json or its folder, or bytes)")
    elif not tok_path.exists():
        if tokenizer == "bytes":
            tok = ByteTokenizer()
        elif tokenizer == "bpe":
            t0 = time.perf_counter()
            say(f"training a byte-level BPE tokenizer of {vocab_size} tokens on {src.path} ...")
            tok = BPETokenizer.train(src.records() if src.format.records else read_text(src.path), vocab_size)
            say(f"tokenizer trained ({time.perf_counter() - t0:.1f} s)")
        else:
            raise GridError(f"tokenizer must be 'bpe' or 'bytes', got {tokenizer!r}")
        atomic_write(tok_path, lambda p: tok.save(p))
    if not tokenize:
        return folder
    meta_path = folder / TOKENS_META
    fp = _fingerprint(src, tok_path)
    if meta_path.exists() and (folder / DOCUMENTS_FILE).exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fp and (meta.get("files") or (folder / TOKENS_FILE).exists()):
            return folder
    tok = load_tokenizer(tok_path)
    t0 = time.perf_counter()
    say(f"tokenizing {src.path} into {folder} ...")
    meta = {"fingerprint": fp, "vocab_size": tok.vocab_size, "tokenizer": tok.kind, "corpus": src.path,
            "format": src.format.value}
    if src.format is Format.TOKENS:  # read where they are: nanoGPT's train.bin (and val.bin), or one file split
        docs = _scan_tokens(src, tok.vocab_size, tok.special_ids().get("eos_token_id"))
        atomic_write(folder / DOCUMENTS_FILE, lambda p: docs.tofile(p))
        count = os.path.getsize(src.files[0]) // np.dtype(src.token_dtype).itemsize
        meta.update(files=[str(f.resolve()) for f in src.files], dtype=src.token_dtype, count=count,
                    documents=len(docs), split=count if len(src.files) > 1 else int(count * (1 - val_fraction)))
    else:
        dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
        texts = src.records() if src.format.records else (text_of(f) for f in src.files)
        unk, unk_id = tok.unknown
        count, ndocs, unknown = _write_streaming(folder, dtype, _documents(src, tok, texts), unk_id)
        if count < 2:
            raise GridError(f"data={src.path} holds no text to train on")
        meta.update(count=count, dtype=np.dtype(dtype).name, documents=ndocs, split=int(count * (1 - val_fraction)),
                    unknown_tokens=unknown)
        if unknown:  # said once, whoever prepares the data
            warn(f"{unknown:,} of {count:,} tokens ({100 * unknown / count:.2f}%) of {src.path} are the tokenizer's "
                 f"unknown token {unk!r}: it cannot represent that part of the corpus")
    atomic_write(meta_path, lambda p: Path(p).write_text(json.dumps(meta, indent=1)))
    say(f"tokenized: {meta['count']:,} tokens in {meta['documents']:,} documents ({time.perf_counter() - t0:.1f} s)")
    return folder


def open_tokens(folder) -> Tokens:
    """The token file of `folder` (or the pre-tokenized files it points at), memory-mapped
    (read-only)."""
    folder = Path(folder)
    meta_path = folder / TOKENS_META
    if not meta_path.exists():
        raise GridError(f"no token file in {folder} (gw.data.prepare makes one)")
    meta = json.loads(meta_path.read_text())
    if meta.get("documents") is None or not (folder / DOCUMENTS_FILE).exists():
        raise GridError(f"the token file in {folder} has no document index (made by an older gridweave): "
                        "gw.data.prepare it again")
    dtype, files = np.dtype(meta["dtype"]), meta.get("files") or [folder / TOKENS_FILE]
    ids = np.memmap(files[0], dtype=dtype, mode="r", shape=(meta["count"],))
    train, val = (ids, np.memmap(files[1], dtype=dtype, mode="r")) if len(files) > 1 else \
        (ids[:meta["split"]], ids[meta["split"]:])
    docs = np.fromfile(folder / DOCUMENTS_FILE, dtype=np.int64)
    if len(docs) != meta["documents"]:
        raise GridError(f"{folder / DOCUMENTS_FILE} holds {len(docs)} document starts, its index says "
                        f"{meta['documents']}: the token file is damaged; prepare it again")
    return Tokens(train, val, meta["vocab_size"], docs)


def unigram_entropy(ids: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequencies of `ids`: the loss of the best model
    that ignores context, which a trained model must beat."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---- the reader ----------------------------------------------------------------------

class Reader:
    """Batches of the training split: global sample k is window perm_e[k mod n] of epoch
    e = k // n (perm_e seeded by (seed, e)); a step takes `batch` samples in `microbatches`
    consecutive micro-batches, and dp rank r reads only its r-th share of each from the memory
    map (one micro-batch: rows [r * batch/dp, (r+1) * batch/dp)). So the step's micro-batch i
    is the same samples on every grid: what a per-micro-batch statistic (a mixture of experts'
    load-balancing loss) sees does not depend on dp. `position` (the samples consumed) is all a
    checkpoint needs to resume exactly."""

    def __init__(self, tokens: np.ndarray, seq: int, batch: int, seed: int, dp_rank: int = 0, dp: int = 1,
                 position: int = 0, microbatches: int = 1):
        self.tokens, self.seq, self.batch, self.seed = tokens, seq, batch, seed
        self.n = (len(tokens) - 1) // seq  # windows of seq + 1 tokens at stride seq
        if self.n < batch:
            raise GridError(f"the training split holds {self.n} windows of {seq + 1} tokens, fewer than a batch "
                            f"of {batch}: use a larger corpus or a shorter seq=")
        if batch % (dp * microbatches):
            raise GridError(f"batch {batch} does not split over {dp} data-parallel ranks x {microbatches} "
                            "micro-batches")
        self.dp_rank, self.shard, self.microbatches = dp_rank, batch // dp, microbatches
        self.position = position
        self._perm = {}

    def _window(self, k: int) -> int:
        e = k // self.n
        if e not in self._perm:
            g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + e)
            self._perm = {e: torch.randperm(self.n, generator=g, device="cpu").numpy()}  # one epoch at a time
        return int(self._perm[e][k % self.n])

    def _samples(self) -> list:
        """The global sample indices of this rank's share of the next step; advances the position
        by the global batch."""
        m = self.microbatches
        mb, per = self.shard // m, self.batch // m  # this rank's rows of a micro-batch, a micro-batch's
        first = self.position + self.dp_rank * mb
        self.position += self.batch
        return [first + i * per + j for i in range(m) for j in range(mb)]

    def _windows(self) -> list:
        """This rank's windows of the next step; advances the position by the global batch."""
        return [self._window(k) for k in self._samples()]

    def _inputs_targets(self, ws: list) -> tuple:
        rows = [self.tokens[w * self.seq:w * self.seq + self.seq + 1] for w in ws]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def next(self):
        """This rank's (inputs, targets) of the next step, int64 on the host; advances the
        position by the global batch."""
        return self._inputs_targets(self._windows())

    def next_packed(self, documents: np.ndarray):
        """next() with the inputs' document ids (b, seq) int64: a window packs the documents that
        `documents` (their starting token indices) say it holds, cut where they start."""
        ws = self._windows()
        ids = [np.searchsorted(documents, np.arange(w * self.seq, (w + 1) * self.seq), side="right") for w in ws]
        return *self._inputs_targets(ws), torch.from_numpy(np.stack(ids).astype(np.int64))

    def next_masked(self, mask_id: int, vocab: int):
        """BERT's (inputs, targets) of this rank's next windows of seq tokens (masked_lm), each
        masked by its global sample index: the same masks whatever the grid."""
        ks = self._samples()
        x, _ = self._inputs_targets([self._window(k) for k in ks])
        return masked_lm(x, ks, self.seed, mask_id, vocab)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "batch": self.batch, "seq": self.seq}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "batch", "seq"):
            if state[k] != getattr(self, k):
                raise GridError(f"the checkpoint's reader has {k} {state[k]}, this run {getattr(self, k)}")
        self.position = int(state["position"])


MASKED, REPLACED_BY_MASK, REPLACED_BY_RANDOM = 0.15, 0.8, 0.1  # Devlin et al. 2019 §3.1 (Task #1)


def masked_lm(windows: torch.Tensor, keys, seed: int, mask_id: int, vocab: int) -> tuple:
    """BERT's masked-LM (inputs, targets) of (b, seq) token windows: 15% of the tokens are
    predicted, of those 80% replaced by mask_id, 10% by a random token of [0, vocab), 10% kept;
    targets are IGNORE elsewhere. Row i draws from a generator seeded by (seed, keys[i]) (its
    sample's global index), so every grid and micro-batching masks a sample alike."""
    if vocab < 1 or mask_id < vocab:
        raise GridError(f"the mask token {mask_id} must lie outside the text's {vocab} tokens")
    inputs, targets = windows.clone(), torch.full_like(windows, IGNORE)
    length = windows.shape[1]
    for i, key in enumerate(keys):
        g = torch.Generator(device="cpu").manual_seed((seed + 1) * 2_000_003 + int(key))
        picked = torch.rand(length, generator=g, device="cpu") < MASKED
        how = torch.rand(length, generator=g, device="cpu")
        random = torch.randint(0, vocab, (length,), generator=g, device="cpu")
        targets[i, picked] = windows[i, picked]
        inputs[i, picked & (how < REPLACED_BY_MASK)] = mask_id
        swap = picked & (how >= REPLACED_BY_MASK) & (how < REPLACED_BY_MASK + REPLACED_BY_RANDOM)
        inputs[i, swap] = random[swap]
    return inputs, targets


def validation_windows(tokens: np.ndarray, seq: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq + 1 tokens of the validation split (the same for
    every grid), int64 (count, seq + 1)."""
    n = (len(tokens) - 1) // seq
    if n < 1:
        raise GridError(f"the validation split ({len(tokens)} tokens) is shorter than one window of {seq + 1}")
    picks = np.linspace(0, n - 1, num=min(count, n)).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[w * seq:w * seq + seq + 1] for w in picks]).astype(np.int64))


def batch(corpus: torch.Tensor, step: int, seed: int, batch_size: int, seq: int):
    """Random windows of a byte corpus for (seed, step) (the benchmarks' data)."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq - 1, (batch_size,), generator=g, device="cpu")
    windows = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]




__all__ = ["ByteTokenizer", "BPETokenizer", "Reader", "Tokens", "Format", "Source", "source", "prepare", "open_tokens", "load_tokenizer",
           "unigram_entropy", "validation_windows", "load_corpus", "batch"]
