"""Sampling from a trained model with a key/value cache: greedy, temperature and top-k.

Generation runs on the dense model in one process: a checkpoint from any grid holds dense
tensors (gw.train.load_model), so every grid's model samples the same way. The cache keeps
each layer's rotated keys and values; a step feeds only the new tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import GridError
from .models import GPT
from .nn.dense import mla_heads, qk_normed, split_heads


class KVCache:
    """Per layer: keys and values (batch, heads, tokens so far, head_dim)."""

    def __init__(self, layers: int):
        self.k = [None] * layers
        self.v = [None] * layers
        self.length = 0

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor):
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
        return self.k[i], self.v[i]


@torch.no_grad()
def forward_cached(model: GPT, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of the new tokens `ids` (batch, n) that follow the cache's tokens; updates the cache."""
    start = cache.length
    n = ids.shape[1]
    if start + n > model.seq:
        raise GridError(f"{start + n} tokens exceed the model's context of {model.seq}")
    pos = torch.arange(start, start + n, device=ids.device)
    x = model.embed.tok(ids)
    if model.embed.pos is not None:
        x = x + model.embed.pos(pos)
    for i, layer in enumerate(model.layers):
        if layer.arch.mla is not None:  # DeepSeek's cache: each token's normalised latent and rotary key
            x = x + _latent_cached(layer.mla, layer.ln1(x), cache, i, start, pos)
            x = x + layer.feed_forward(layer.ln2(x))
            continue
        qkv = qk_normed(layer.qkv(layer.ln1(x)), layer.heads, layer.kv_heads, layer.q_norm, layer.k_norm,
                        layer.arch.eps)
        q, k, v = split_heads(qkv, layer.heads, layer.kv_heads, layer.arch, pos)
        k, v = cache.append(i, k, v)
        # the new queries see every cached token and the new ones causally
        mask = torch.ones(n, start + n, dtype=torch.bool, device=ids.device).tril(start)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + layer.proj(o.transpose(1, 2).reshape(x.shape[0], n, -1))
        x = x + layer.feed_forward(layer.ln2(x))
    cache.length = start + n
    return model.head(x)


def _latent_cached(attn, h: torch.Tensor, cache: KVCache, i: int, start: int, pos: torch.Tensor) -> torch.Tensor:
    """A latent-attention layer's output for the new tokens h: the cache holds, per token, the
    normalised kv latent and the unrotated rotary key (kv_rank + rope values: MLA's small cache,
    DeepSeek-V2 §2.1.2); keys and values are up-projected from it."""
    m, n = attn.mla, h.shape[1]
    latent, k_rope = attn.kv_down(h).split([m.kv_rank, m.rope], dim=-1)
    latent, k_rope = cache.append(i, attn.kv_norm(latent)[:, None], k_rope[:, None])
    q, k, v = mla_heads(attn.queries(h), attn.kv_up(latent[:, 0]), k_rope[:, 0], attn.heads, m, attn.theta, pos,
                        torch.arange(start + n, device=h.device))
    mask = torch.ones(n, start + n, dtype=torch.bool, device=h.device).tril(start)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.proj(o.transpose(1, 2).reshape(h.shape[0], n, -1))


def pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """Next token per row: greedy at temperature 0, else sampled from the top_k (None: all)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def check_sampling(max_new: int, temperature: float, top_k: int | None) -> None:
    """sample's settings, checked before any model is loaded."""
    import math

    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise GridError(f"temperature must be a number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise GridError(f"top_k must be >= 1, got {top_k}")
    if max_new < 0:
        raise GridError(f"the new tokens must be >= 0, got {max_new}")


def sample(model: GPT, prompt_ids: list, max_new: int, temperature: float = 0.8, top_k: int | None = 40,
           seed: int = 0, vocab: int | None = None) -> list:
    """Token ids of `prompt_ids` continued by `max_new` tokens. vocab: the tokenizer's size
    (padding rows of a padded vocabulary are never sampled)."""
    check_sampling(max_new, temperature, top_k)
    if not prompt_ids:
        raise GridError("the prompt has no tokens")
    if len(prompt_ids) + max_new > model.seq:
        raise GridError(f"prompt ({len(prompt_ids)} tokens) + {max_new} new tokens exceed the model's context "
                        f"of {model.seq}")
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(len(model.layers))
    out = list(prompt_ids)
    logits = forward_cached(model, torch.tensor([out], device=device), cache)[:, -1]
    for t in range(max_new):
        if vocab is not None:
            logits[..., vocab:] = float("-inf")
        nxt = int(pick(logits.float(), temperature, top_k, g)[0])
        out.append(nxt)
        if t + 1 < max_new:
            logits = forward_cached(model, torch.tensor([[nxt]], device=device), cache)[:, -1]
    return out
