"""A transformer layer in each tensor-parallel mode, checked against DenseTransformerLayer.

mode "1d": Megatron (seed 003): LayerNorm replicated, qkv / fc1 column-parallel, proj /
           fc2 row-parallel: four all-reduces per layer (two g forward, two f backward).
mode "2d": SUMMA Linear2D / LayerNorm2D on a q x q grid, heads split over "c".
mode "3d": Linear3D / LayerNorm3D on the cube (seed 000 Fig. 6); the first linear of each
           block swaps the directions (a, c) and the second swaps them back, so the layer's
           input and output layouts match.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GridError
from ..layout import Layout
from .dense import DenseMLP, DenseSelfAttention, DenseTransformerLayer, head_group_order, values
from .tensor1d import ColumnParallelLinear, RowParallelLinear
from .tensor2d import ACTIVATION as ACT2D
from .tensor2d import LayerNorm2D, Linear2D
from .tensor3d import LayerNorm3D, Linear3D, activation_layout
from ..autograd.ring import ring_attention, ring_self_attention
from .sequence import ReplicatedLinear, attend, reduce_gradients, sequence_parallel
from .subgraph import SubGraphAttention, subgraph_layout

MODES = ("1d", "2d", "3d", "sp", "dsp", "csub")


def _linears(mode, grid, bias, overlap, a, c, dtype):
    """Constructors for the first (in -> wide) and second (wide -> in) linear of a block."""
    kw = dict(dtype=dtype)
    if mode == "1d":
        return (lambda i, o: ColumnParallelLinear(i, o, grid, bias, **kw),
                lambda i, o: RowParallelLinear(i, o, grid, bias, **kw))
    if mode == "2d":
        return (lambda i, o: Linear2D(i, o, grid, bias, **kw),) * 2
    if mode in ("sp", "dsp", "csub"):  # weights replicated: sequence, sub-graph common layers
        return (lambda i, o: ReplicatedLinear(i, o, bias, **kw),) * 2
    # 3-D: the first linear takes (a, c) to (c, a); the second swaps them back (§3.2)
    return (lambda i, o: Linear3D(i, o, grid, bias, a, c, overlap, **kw),
            lambda i, o: Linear3D(i, o, grid, bias, c, a, overlap, **kw))


def _activation(mode, a, c, zigzag=False, sp=False):
    """Layout of a block's (batch, seq, hidden) input and output in each mode; `sp`: the
    sequence is also split over the "sp" axis (zigzag for causal ring attention)."""
    if mode == "sp":
        return Layout(("dp",), ("sp",), (), zigzag=1 if zigzag else None)
    if mode in ("dsp", "csub"):
        return subgraph_layout(mode, sp, zigzag)
    base = {"1d": Layout(), "2d": ACT2D, "3d": activation_layout(a, c)}[mode]
    if not sp:
        return base
    dims = list(base.dims) + [()] * (3 - len(base.dims))
    dims[1] = ("sp",)
    return Layout(*dims, zigzag=1 if zigzag else None)


def _groups(mode, grid):
    if mode not in MODES:
        raise GridError(f"mode must be one of {MODES}, got {mode!r}")
    return {"1d": lambda: grid.size("tp"), "2d": lambda: grid.axes["c"], "3d": lambda: grid.axes["x"],
            "sp": lambda: 1, "dsp": lambda: 1, "csub": lambda: 1}[mode]()


class SelfAttention(nn.Module):
    """qkv -> attention on this rank's heads -> proj. Heads are split over the tensor-
    parallel groups (1-D: tp; 2-D: c; 3-D: the a direction of the qkv output)."""

    def __init__(self, hidden, heads, grid, mode="3d", bias=True, causal=True, overlap=False, a="y", c="z",
                 dtype=None, attention="ring"):
        super().__init__()
        if attention not in ("ring", "rsa"):
            raise GridError(f"attention must be 'ring' (blockwise) or 'rsa' (seed 004's), got {attention!r}")
        self.attention = attention
        self.groups = _groups(mode, grid)
        if heads % self.groups:
            raise GridError(f"{heads} heads do not split over {self.groups} tensor-parallel groups")
        self.grid, self.mode, self.a, self.c, self.bias = grid, mode, a, c, bias
        self.hidden, self.heads, self.causal = hidden, heads, causal
        first, second = _linears(mode, grid, bias, overlap, a, c, dtype)
        self.qkv, self.proj = first(hidden, 3 * hidden), second(hidden, hidden)

    @property
    def input_layout(self):
        return _activation(self.mode, self.a, self.c, self.zigzag, sequence_parallel(self.grid))

    output_layout = input_layout

    @property
    def zigzag(self):
        return (self.mode == "sp" or sequence_parallel(self.grid)) and self.attention == "ring" and self.causal

    def forward(self, x):
        if self.mode != "sp":
            return self.proj(attend(self.qkv(x), self.heads // self.groups, self.causal, self.grid, self.attention))
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(self.hidden, -1))
        if self.attention == "rsa":
            o = ring_self_attention(q, k, v, self.grid, "sp", self.causal)
        else:
            o = ring_attention(q, k, v, self.grid, "sp", self.causal, self.zigzag)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.hidden))

    @classmethod
    def from_dense(cls, dense: DenseSelfAttention, grid, mode="3d", **kw):
        m = cls(dense.qkv.in_features, dense.heads, grid, mode, bias=dense.qkv.bias is not None, causal=dense.causal,
                dtype=dense.qkv.weight.dtype, **kw)
        m.load_dense(dense.qkv, dense.proj)
        return m

    def to_dense(self):
        d = DenseSelfAttention(self.hidden, self.heads, self.bias, self.causal, dtype=self.qkv.weight.dtype)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d

    def load_dense(self, qkv: nn.Linear, proj: nn.Linear):
        self.qkv.load_dense(qkv, head_group_order(self.hidden, self.groups))
        self.proj.load_dense(proj)

    def dense_state(self, grad=False):
        out = {f"qkv.{k}": v for k, v in self.qkv.dense_state(grad).items()}
        out.update({f"proj.{k}": v for k, v in self.proj.dense_state(grad).items()})
        inv = torch.argsort(head_group_order(self.hidden, self.groups))
        for k in ("qkv.weight", "qkv.bias"):
            if k in out:
                out[k] = out[k][inv]
        return out


class RingSelfAttention(SelfAttention):
    """Seed 004's Ring Self-Attention block: qkv and proj replicated, RSA over "sp"."""

    def __init__(self, hidden, heads, grid, causal=False, bias=True, dtype=None):
        super().__init__(hidden, heads, grid, "sp", bias, causal, dtype=dtype, attention="rsa")

    @classmethod
    def from_dense(cls, dense: DenseSelfAttention, grid):
        m = cls(dense.qkv.in_features, dense.heads, grid, dense.causal, dense.qkv.bias is not None,
                dense.qkv.weight.dtype)
        m.load_dense(dense.qkv, dense.proj)
        return m


class RingAttention(SelfAttention):
    """Blockwise ring attention block (online softmax; zigzag sequence layout when causal)."""

    def __init__(self, hidden, heads, grid, causal=True, bias=True, dtype=None):
        super().__init__(hidden, heads, grid, "sp", bias, causal, dtype=dtype, attention="ring")

    from_dense = RingSelfAttention.__dict__["from_dense"]


class MLP(nn.Module):
    """fc1 -> GeLU -> fc2 (1-D: column then row parallel; 3-D: directions swap and back)."""

    def __init__(self, hidden, ffn_hidden, grid, mode="3d", bias=True, overlap=False, a="y", c="z", dtype=None):
        super().__init__()
        _groups(mode, grid)
        self.grid, self.mode, self.a, self.c, self.bias = grid, mode, a, c, bias
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        first, second = _linears(mode, grid, bias, overlap, a, c, dtype)
        self.fc1, self.fc2 = first(hidden, ffn_hidden), second(ffn_hidden, hidden)

    @property
    def input_layout(self):
        # token-wise: any sequence order works; the contiguous one is reported
        return _activation(self.mode, self.a, self.c, False, sequence_parallel(self.grid))

    output_layout = input_layout

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    @classmethod
    def from_dense(cls, dense: DenseMLP, grid, mode="3d", **kw):
        m = cls(dense.fc1.in_features, dense.fc1.out_features, grid, mode, bias=dense.fc1.bias is not None,
                dtype=dense.fc1.weight.dtype, **kw)
        m.load_dense(dense.fc1, dense.fc2)
        return m

    def to_dense(self):
        d = DenseMLP(self.hidden, self.ffn_hidden, self.bias, dtype=self.fc1.weight.dtype)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d

    def load_dense(self, fc1: nn.Linear, fc2: nn.Linear):
        self.fc1.load_dense(fc1)
        self.fc2.load_dense(fc2)

    def dense_state(self, grad=False):
        out = {f"fc1.{k}": v for k, v in self.fc1.dense_state(grad).items()}
        out.update({f"fc2.{k}": v for k, v in self.fc2.dense_state(grad).items()})
        return out


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads, grid, mode="3d", ffn_hidden=None, bias=True, causal=True, overlap=False,
                 a="y", c="z", dtype=None, attention="ring", projection="branch", method="all_to_all"):
        super().__init__()
        _groups(mode, grid)
        ffn_hidden = ffn_hidden or 4 * hidden
        self.grid, self.mode, self.hidden, self.heads, self.causal = grid, mode, hidden, heads, causal
        self.ffn_hidden, self.overlap, self.a, self.c, self.bias = ffn_hidden, overlap, a, c, bias
        kw = dict(dtype=dtype)
        if mode in ("1d", "sp", "dsp", "csub"):
            self.ln1, self.ln2 = nn.LayerNorm(hidden, **kw), nn.LayerNorm(hidden, **kw)
        elif mode == "2d":
            self.ln1, self.ln2 = LayerNorm2D(hidden, grid, **kw), LayerNorm2D(hidden, grid, **kw)
        else:
            self.ln1, self.ln2 = LayerNorm3D(hidden, grid, a, c, **kw), LayerNorm3D(hidden, grid, a, c, **kw)
        if mode in ("dsp", "csub"):
            self.attn = SubGraphAttention(hidden, heads, grid, mode, projection, method, causal, bias, dtype)
        else:
            self.attn = SelfAttention(hidden, heads, grid, mode, bias, causal, overlap, a, c, dtype, attention)
        self.mlp = MLP(hidden, ffn_hidden, grid, mode, bias, overlap, a, c, dtype)

    @property
    def input_layout(self):
        return self.attn.input_layout

    output_layout = input_layout

    def linears(self):
        return (self.attn.qkv, self.attn.proj, self.mlp.fc1, self.mlp.fc2)

    def prefetch(self):
        """3-D: start the weight all-gathers (in x) of this layer's four linears, async; call
        it on the next layer while this one computes, or let overlap=True do it per layer."""
        if self.mode == "3d":
            for lin in self.linears():
                lin.prefetch()

    def forward(self, x):
        if self.mode == "3d" and self.overlap:
            self.prefetch()
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    @classmethod
    def from_dense(cls, dense: DenseTransformerLayer, grid, mode="3d", **kw):
        hidden = dense.ln1.normalized_shape[0]
        m = cls(hidden, dense.heads, grid, mode, ffn_hidden=dense.fc1.out_features, bias=dense.qkv.bias is not None,
                causal=dense.causal, dtype=dense.qkv.weight.dtype, **kw)
        m.load_dense(dense)
        return m

    def load_dense(self, dense):
        self.attn.load_dense(dense.qkv, dense.proj)
        self.mlp.load_dense(dense.fc1, dense.fc2)
        for name in ("ln1", "ln2"):
            mine, theirs = getattr(self, name), getattr(dense, name)
            if self.mode in ("1d", "sp", "dsp", "csub"):
                mine.load_state_dict(theirs.state_dict())
            else:
                mine.load_dense(theirs)

    def dense_state(self, grad=False):
        """Full tensors under DenseTransformerLayer's names (grad=True: their gradients)."""
        out = {**self.attn.dense_state(grad), **self.mlp.dense_state(grad)}
        for name in ("ln1", "ln2"):
            ln = getattr(self, name)
            if self.mode in ("1d", "sp", "dsp", "csub"):
                state = {k: values(grad)(p).clone() for k, p in ln.named_parameters()}
            else:
                state = ln.dense_state(grad)
            out.update({f"{name}.{k}": v for k, v in state.items()})
        return out

    def reduce_gradients(self):
        """Sub-graph modes: common parameters summed over (dp, sg), branch ones over dp.
        Sequence parallel: everything over (dp, sp). Use with gw.nn.global_token_mean."""
        if self.mode in ("dsp", "csub"):
            from .subgraph import reduce_gradients_of

            branch = {id(p) for p in self.attn.branch_parameters()}
            reduce_gradients_of([p for p in self.parameters() if id(p) not in branch], self.grid, ("dp", "sg"))
            reduce_gradients_of(self.attn.branch_parameters(), self.grid, ("dp",))
        elif self.mode == "sp":
            reduce_gradients(self, self.grid, ("dp", "sp"))

    def to_dense(self):
        d = DenseTransformerLayer(self.hidden, self.heads, self.ffn_hidden, bias=self.bias, causal=self.causal,
                                  dtype=self.attn.qkv.weight.dtype)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d
