"""Models built from gridweave's layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import GridError
from .nn.dense import DenseTransformerLayer


class Embedding(nn.Module):
    """Token + learned position embeddings: (batch, seq) ids -> (batch, seq, hidden)."""

    def __init__(self, vocab, hidden, seq, dtype=None):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, dtype=dtype)
        self.pos = nn.Embedding(seq, hidden, dtype=dtype)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    def __init__(self, vocab, hidden, dtype=None):
        super().__init__()
        self.ln = nn.LayerNorm(hidden, dtype=dtype)
        self.out = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, x):
        return self.out(self.ln(x))


class GPT(nn.Module):
    """A GPT: embedding, `layers` pre-LN causal transformer layers, head."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, dtype=None):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.embed = Embedding(vocab, hidden, seq, dtype)
        self.layers = nn.ModuleList(DenseTransformerLayer(hidden, heads, dtype=dtype) for _ in range(layers))
        self.head = Head(vocab, hidden, dtype)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    @staticmethod
    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def stage_layers(self, stage: int, stages: int) -> list:
        """Stage `stage` of `stages`: the embedding on the first, the head on the last, the
        transformer layers split evenly."""
        n = len(self.layers)
        if n % stages:
            raise GridError(f"{n} layers do not split over {stages} pipeline stages")
        k = n // stages
        mods = list(self.layers[stage * k:(stage + 1) * k])
        if stage == 0:
            mods = [self.embed] + mods
        if stage == stages - 1:
            mods = mods + [self.head]
        return mods
