"""Dense single-process references, and helpers shared by the parallel modules."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def attention(qkv: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """Multi-head attention on [q | k | v] packed along the last dim: (b, s, 3h) -> (b, s, h)."""
    b, s, three_h = qkv.shape
    h = three_h // 3
    q, k, v = (t.reshape(b, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2).reshape(b, s, h)


def head_group_order(hidden: int, groups: int, device="cpu") -> torch.Tensor:
    """Row order of a packed [q | k | v] projection that makes `groups` equal column
    blocks, block t = [q_t | k_t | v_t] (the heads of group t), so heads split cleanly."""
    w = hidden // groups
    idx = [part * hidden + t * w + k for t in range(groups) for part in range(3) for k in range(w)]
    return torch.tensor(idx, dtype=torch.int64, device=device)


class DenseSelfAttention(nn.Module):
    """proj(attention(qkv(x))): the dense reference of SelfAttention."""

    def __init__(self, hidden: int, heads: int, bias: bool = True, causal: bool = True, dtype=None, device=None):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x):
        return self.proj(attention(self.qkv(x), self.heads, self.causal))


class DenseMLP(nn.Module):
    """fc2(gelu(fc1(x))): the dense reference of MLP."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, dtype=None, device=None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DenseTransformerLayer(nn.Module):
    """Pre-LayerNorm GPT layer: x + proj(attn(qkv(ln1 x))), then x + fc2(gelu(fc1(ln2 x)))."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None, bias: bool = True,
                 causal: bool = True, dtype=None, device=None):
        super().__init__()
        ffn_hidden = ffn_hidden or 4 * hidden
        kw = dict(dtype=dtype, device=device)
        self.heads, self.causal = heads, causal
        self.ln1 = nn.LayerNorm(hidden, **kw)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias, **kw)
        self.proj = nn.Linear(hidden, hidden, bias=bias, **kw)
        self.ln2 = nn.LayerNorm(hidden, **kw)
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias, **kw)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, **kw)

    def forward(self, x):
        x = x + self.proj(attention(self.qkv(self.ln1(x)), self.heads, self.causal))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def dense_linear(state: dict, in_features: int, out_features: int) -> nn.Linear:
    """A torch Linear holding full tensors assembled by a parallel module's dense_state()."""
    w = state["weight"]
    lin = nn.Linear(in_features, out_features, bias="bias" in state, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(state["weight"])
        if "bias" in state:
            lin.bias.copy_(state["bias"])
    return lin


def dense_layernorm(state: dict, hidden: int, eps: float) -> nn.LayerNorm:
    ln = nn.LayerNorm(hidden, eps=eps, dtype=state["weight"].dtype, device=state["weight"].device)
    with torch.no_grad():
        ln.weight.copy_(state["weight"])
        ln.bias.copy_(state["bias"])
    return ln


def values(grad):
    """Picks, for dense_state(), a parameter's value (False), its gradient (True), or any
    tensor shaped like it (a callable param -> tensor, e.g. an optimizer state)."""
    if callable(grad):
        return grad
    return (lambda t: t.grad) if grad else (lambda t: t.detach())


def linear_tensors(dense: nn.Linear, order=None):
    """(weight, bias) of a dense Linear, output rows reordered by `order` if given."""
    w, b = dense.weight.detach(), None if dense.bias is None else dense.bias.detach()
    if order is not None:
        w, b = w[order], (None if b is None else b[order])
    return w, b


class ParallelLinearBase(nn.Module):
    """from_dense / to_dense for every parallel linear; subclasses define load_dense and dense_state."""

    @classmethod
    def from_dense(cls, dense: nn.Linear, grid, **kw):
        kw.setdefault("dtype", dense.weight.dtype)
        m = cls(dense.in_features, dense.out_features, grid, bias=dense.bias is not None, **kw)
        m.load_dense(dense)
        return m

    def to_dense(self) -> nn.Linear:
        return dense_linear(self.dense_state(), self.in_features, self.out_features)
