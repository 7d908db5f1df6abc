"""Byte-level text data for the main job: a real English corpus installed by the set-up
command (Debian's `fortunes` package), or any text file or folder given with --data."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import GridError

DEFAULT_CORPUS = "/usr/share/games/fortunes"


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All text files under `path` (default: the fortunes corpus) as uint8 byte tokens."""
    root = Path(path or DEFAULT_CORPUS)
    if not root.exists():
        raise GridError(f"no text corpus at {root}: install Debian's 'fortunes' package (scripts/setup.sh "
                        "does) or pass --data PATH to a text file or folder")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and not p.name.endswith((".dat", ".u8")) and not p.is_symlink())
    data = b"".join(p.read_bytes() for p in files)
    if len(data) < 1024:
        raise GridError(f"the corpus at {root} holds only {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def batch(corpus: torch.Tensor, step: int, seed: int, batch_size: int, seq: int):
    """The step's (inputs, targets): batch_size windows of seq+1 bytes, the same on every
    rank and in every grid for a given (seed, step), so runs are comparable. On the host
    (the corpus is host memory); the job moves them to its device."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq - 1, (batch_size,), generator=g, device="cpu")
    windows = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def corpus_size(path: str | None = None) -> int:
    root = Path(path or DEFAULT_CORPUS)
    return sum(os.path.getsize(p) for p in ([root] if root.is_file() else root.rglob("*")) if Path(p).is_file())
