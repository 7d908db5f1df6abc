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
from .dense import DenseTransformerLayer, attention, head_group_order
from .tensor1d import ColumnParallelLinear, RowParallelLinear
from .tensor2d import ACTIVATION as ACT2D
from .tensor2d import LayerNorm2D, Linear2D
from .tensor3d import LayerNorm3D, Linear3D, activation_layout

MODES = ("1d", "2d", "3d")


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads, grid, mode="3d", ffn_hidden=None, bias=True, causal=True, overlap=False,
                 a="y", c="z", dtype=None):
        super().__init__()
        if mode not in MODES:
            raise GridError(f"mode must be one of {MODES}, got {mode!r}")
        ffn_hidden = ffn_hidden or 4 * hidden
        self.grid, self.mode, self.hidden, self.heads, self.causal = grid, mode, hidden, heads, causal
        self.ffn_hidden, self.overlap, self.a, self.c = ffn_hidden, overlap, a, c
        self.groups = {"1d": lambda: grid.size("tp"), "2d": lambda: grid.axes["c"],
                       "3d": lambda: grid.axes["x"]}[mode]()
        if heads % self.groups:
            raise GridError(f"{heads} heads do not split over {self.groups} tensor-parallel groups")
        kw = dict(dtype=dtype)
        if mode == "1d":
            self.ln1, self.ln2 = nn.LayerNorm(hidden, **kw), nn.LayerNorm(hidden, **kw)
            self.qkv = ColumnParallelLinear(hidden, 3 * hidden, grid, bias, **kw)
            self.proj = RowParallelLinear(hidden, hidden, grid, bias, **kw)
            self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, grid, bias, **kw)
            self.fc2 = RowParallelLinear(ffn_hidden, hidden, grid, bias, **kw)
        elif mode == "2d":
            self.ln1, self.ln2 = LayerNorm2D(hidden, grid, **kw), LayerNorm2D(hidden, grid, **kw)
            self.qkv = Linear2D(hidden, 3 * hidden, grid, bias, **kw)
            self.proj = Linear2D(hidden, hidden, grid, bias, **kw)
            self.fc1 = Linear2D(hidden, ffn_hidden, grid, bias, **kw)
            self.fc2 = Linear2D(ffn_hidden, hidden, grid, bias, **kw)
        else:
            self.ln1 = LayerNorm3D(hidden, grid, a, c, **kw)
            self.ln2 = LayerNorm3D(hidden, grid, a, c, **kw)
            self.qkv = Linear3D(hidden, 3 * hidden, grid, bias, a, c, overlap, **kw)
            self.proj = Linear3D(hidden, hidden, grid, bias, c, a, overlap, **kw)
            self.fc1 = Linear3D(hidden, ffn_hidden, grid, bias, a, c, overlap, **kw)
            self.fc2 = Linear3D(ffn_hidden, hidden, grid, bias, c, a, overlap, **kw)

    @property
    def input_layout(self):
        return {"1d": Layout(), "2d": ACT2D, "3d": activation_layout(self.a, self.c)}[self.mode]

    output_layout = input_layout

    def prefetch(self):
        """3-D: start the weight all-gathers of this layer's four linears (async, in x)."""
        if self.mode == "3d":
            for lin in (self.qkv, self.proj, self.fc1, self.fc2):
                lin.prefetch()

    def forward(self, x):
        if self.mode == "3d" and self.overlap:
            self.prefetch()
        qkv = self.qkv(self.ln1(x))
        x = x + self.proj(attention(qkv, self.heads // self.groups, self.causal))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    @classmethod
    def from_dense(cls, dense: DenseTransformerLayer, grid, mode="3d", **kw):
        hidden = dense.ln1.normalized_shape[0]
        m = cls(hidden, dense.heads, grid, mode, ffn_hidden=dense.fc1.out_features, bias=dense.qkv.bias is not None,
                causal=dense.causal, dtype=dense.qkv.weight.dtype, **kw)
        m.load_dense(dense)
        return m

    def load_dense(self, dense):
        order = head_group_order(self.hidden, self.groups)
        self.qkv.load_dense(dense.qkv, order)
        for name in ("proj", "fc1", "fc2"):
            getattr(self, name).load_dense(getattr(dense, name))
        for name in ("ln1", "ln2"):
            mine, theirs = getattr(self, name), getattr(dense, name)
            if self.mode == "1d":
                mine.load_state_dict(theirs.state_dict())
            else:
                mine.load_dense(theirs)

    def dense_state(self, grad=False):
        """Full tensors under the dense layer's names (grad=True: their gradients)."""
        out = {}
        for name in ("qkv", "proj", "fc1", "fc2"):
            for k, v in getattr(self, name).dense_state(grad).items():
                out[f"{name}.{k}"] = v
        inv = torch.argsort(head_group_order(self.hidden, self.groups))
        out["qkv.weight"] = out["qkv.weight"][inv]
        if "qkv.bias" in out:
            out["qkv.bias"] = out["qkv.bias"][inv]
        for name in ("ln1", "ln2"):
            ln = getattr(self, name)
            if self.mode == "1d":
                state = {k: (p.grad if grad else p.detach()).clone() for k, p in ln.named_parameters()}
            else:
                state = ln.dense_state(grad)
            for k, v in state.items():
                out[f"{name}.{k}"] = v
        return out

    def to_dense(self):
        d = DenseTransformerLayer(self.hidden, self.heads, self.ffn_hidden, bias=self.qkv.bias is not None,
                                  causal=self.causal, dtype=self.qkv.weight.dtype)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d
