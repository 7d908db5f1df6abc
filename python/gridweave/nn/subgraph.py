"""Sub-graph parallelism (SUPER, SUPER): attention heads are the branches, one head group
per sub-grid; common layers data-parallel over every rank (D&SP) or on sub-grid 0 (cSub)."""
from __future__ import annotations

import torch
from torch import nn

from .. import split
from ..autograd import subgraph as sgops
from ..axes import AxesView
from ..errors import GridError
from ..layout import Layout
from ..sharding import group_order, place, set_row_order
from .dense import GPT2, DenseSelfAttention, values
from .sequence import ReplicatedLinear, attend
from .style import Branches, Style, find, resolve


def subgraph_layout(mode, sp=False, causal=False):
    """(batch, seq, hidden) of the common layers: D&SP splits the batch over (dp, sg); cSub
    over dp on sub-grid 0, the other sub-grids holding nothing; the sequence over sp
    (zigzag when causal). `mode`: gw.SubGraph / gw.CSub or "dsp" / "csub"."""
    cls = type(mode) if isinstance(mode, Style) else find(mode)
    if cls is None or not issubclass(cls, Branches):
        raise GridError(f"sub-graph mode must be gw.SubGraph, gw.CSub, 'dsp' or 'csub', got {mode!r}")
    return cls(1).layout(AxesView({"sp": 2 if sp else 1}), causal)  # the mode's own sp rule


class SubGraphAttention(nn.Module, split.Deferrable):
    """projection="branch": split -> [qkv_k, attention of head group k, proj_k] -> sum (the
    branches own their projections; their gradients are reduced within the sub-grid).
    projection="common": qkv (common) -> slice -> attention of group k -> concat -> proj.
    method: how D&SP slices and concatenates: "all_to_all" (default: measured faster here,
    benchmarks/results/subgraph.json) or "all_gather" (gather everything, keep one slice:
    the paper's choice on NCCL, which had no fast all-to-all)."""

    def __init__(self, hidden, heads, grid, mode="dsp", projection="branch", method="all_to_all", causal=True,
                 bias=True, dtype=None, device=None, arch=None):
        super().__init__()
        if "sg" not in grid.axes:
            raise GridError("sub-graph parallelism needs gw.init(tp=gw.SubGraph(g))")
        mode = resolve(mode, grid)
        if not isinstance(mode, Branches):
            raise GridError(f"sub-graph attention needs gw.SubGraph or gw.CSub, got {mode!r}")
        if projection not in ("branch", "common"):
            raise GridError(f"projection must be 'branch' or 'common', got {projection!r}")
        g = grid.axes["sg"]
        self.arch = arch = arch or GPT2
        if arch.qk_norm:
            raise GridError("per-head query/key norms (qk_norm, Qwen3's) run with tp none or row:N, not in "
                            "sub-graph branches")
        self.kv_heads = arch.kv(heads)
        if heads % g or hidden % g or self.kv_heads % g:
            raise GridError(f"{heads} heads ({self.kv_heads} key/value heads) / hidden {hidden} do not split over "
                            f"{g} sub-grids (key/value heads are not replicated)")
        self.widths = arch.qkv_widths(hidden, heads)
        width = sum(self.widths)
        sgops._method(method)
        self.grid, self.mode, self.projection, self.method = grid, mode, projection, method
        self.hidden, self.heads, self.causal, self.g = hidden, heads, causal, g
        kw = dict(dtype=dtype, device=device or grid.device)
        common = mode.common_partial()
        qkv_bias = bias or arch.qkv_bias  # Qwen2's: biases on q, k and v alone
        if projection == "branch":
            self.qkv = ReplicatedLinear(hidden, width // g, qkv_bias, **kw)       # branch k's heads
            self.proj = ReplicatedLinear(hidden // g, hidden, False, **kw)       # branch k's columns
            place(self.qkv.weight, Layout(("sg",)))
            if qkv_bias:
                place(self.qkv.bias, Layout(("sg",)))
            place(self.proj.weight, Layout((), ("sg",)))
            self.proj_bias = place(nn.Parameter(torch.zeros(hidden, **kw)), partial=common) if bias else None
        else:
            self.qkv = ReplicatedLinear(hidden, width, qkv_bias, partial=common, **kw)
            self.proj = ReplicatedLinear(hidden, hidden, bias, partial=common, **kw)
            self.proj_bias = None
        set_row_order(self.qkv.weight, self.widths, g)  # the head groups' [q_k | k_k | v_k] blocks
        set_row_order(self.qkv.bias, self.widths, g)

    @property
    def input_layout(self):
        return self.mode.layout(self.grid, self.causal)

    output_layout = input_layout

    # the common shard's shape of the step's micro-batch where the stage knows it (GPTStage.activation_shape)
    common_shape_hint = None

    def forward(self, x):
        mode, grid = self.mode, self.grid
        shape = mode.common_shape(x, grid, self.common_shape_hint)
        if self.projection == "branch":
            xb = mode.split(x, grid, shape)
            y = self.proj(self._attend(self.qkv(xb)))
            out = mode.branch_sum(y, grid)
            return split.apart(self.weight_store, torch.add, out, self.proj_bias) if self.proj_bias is not None else out
        qkv = self.qkv(x)
        qshape = tuple(shape[:-1]) + (sum(self.widths),) if shape is not None else None
        branch = mode.slice_(qkv, grid, self.method, qshape)
        return self.proj(mode.concat(self._attend(branch), grid, self.method))

    def _attend(self, qkv):
        """Attention of this branch's head group (its query and key/value heads)."""
        return attend(qkv, self.heads // self.g, self.causal, self.grid, kv_heads=self.kv_heads // self.g,
                      arch=self.arch)

    @classmethod
    def from_dense(cls, dense: DenseSelfAttention, grid, mode="dsp", **kw):
        m = cls(dense.qkv.in_features, dense.heads, grid, mode, causal=dense.causal, bias=dense.proj.bias is not None,
                dtype=dense.qkv.weight.dtype, arch=dense.arch, **kw)
        m.load_dense(dense.qkv, dense.proj)
        return m

    def load_dense(self, qkv: nn.Linear, proj: nn.Linear, lowrank=None, q_norm=None, k_norm=None):
        """lowrank, q_norm, k_norm: Linformer's and Qwen3's, which SUPER's branches refuse when the
        layer is made (always None)."""
        order = group_order(self.widths, self.g, qkv.weight.device)
        if self.projection == "common":
            self.qkv.load_dense(qkv, order)
            self.proj.load_dense(proj)
            return
        k, w = self.grid.index("sg"), sum(self.widths) // self.g
        rows = order[k * w:(k + 1) * w]
        cols = slice(k * self.hidden // self.g, (k + 1) * self.hidden // self.g)
        with torch.no_grad():
            self.qkv.weight.copy_(qkv.weight[rows])
            if self.qkv.bias is not None:
                self.qkv.bias.copy_(qkv.bias[rows])
            self.proj.weight.copy_(proj.weight[:, cols])
            if self.proj_bias is not None:
                self.proj_bias.copy_(proj.bias)

    def dense_state(self, grad=False):
        pick = values(grad)
        inv = torch.argsort(group_order(self.widths, self.g, self.qkv.weight.device))
        if self.projection == "common":
            out = {f"qkv.{k}": v for k, v in self.qkv.dense_state(grad).items()}
            out.update({f"proj.{k}": v for k, v in self.proj.dense_state(grad).items()})
        else:  # each sub-grid holds one head group: gather them along sg
            out = {"qkv.weight": self.grid.all_gather(pick(self.qkv.weight).contiguous(), axis="sg"),
                   "proj.weight": self.grid.all_gather(pick(self.proj.weight).contiguous(), axis="sg", dim=1)}
            if self.qkv.bias is not None:
                out["qkv.bias"] = self.grid.all_gather(pick(self.qkv.bias).contiguous(), axis="sg")
            if self.proj_bias is not None:
                out["proj.bias"] = pick(self.proj_bias).clone()
        out["qkv.weight"] = out["qkv.weight"][inv]
        if "qkv.bias" in out:
            out["qkv.bias"] = out["qkv.bias"][inv]
        return out

    def to_dense(self):
        d = DenseSelfAttention(self.hidden, self.heads, "qkv.bias" in self.dense_state(), self.causal,
                               dtype=self.qkv.weight.dtype, device=self.qkv.weight.device, arch=self.arch)
        with torch.no_grad():
            d.load_state_dict(self.dense_state())
        return d
