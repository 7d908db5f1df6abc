"""Mixture of experts: the sparse MLP of Mixtral, Qwen-MoE and DeepSeek-MoE.

A router scores every token against every expert (softmax over router logits), keeps the
top-k, optionally renormalises their weights (Mixtral: yes; Qwen2-MoE: norm_topk_prob);
the token slots are sorted by expert (dispatch), each expert runs a SwiGLU MLP on its
contiguous rows (a grouped GEMM as a loop of torch products over the groups), and the
results, weighted, are summed back per token (combine). Dropless by default; with a
capacity factor each expert keeps at most ceil(cf x tokens x k / experts) slots, the most
probable ones (Megatron-Core's drop policy "probs"); a dropped slot adds nothing, so a token
whose slots all drop passes through the layer's residual unchanged.

Two auxiliary losses, attached to the block's output (Megatron-Core's MoEAuxLossAutoScaler:
the backward of whatever loss the output reaches also back-propagates them, so pipeline
stages need no second loss): the load-balancing loss of Switch / Mixtral, E sum_e f_e P_e
(f_e: the share of the tokens routed to expert e, counting every top-k slot; P_e: the mean
router probability of e; transformers' load_balancing_loss_func, per layer), and the router
z-loss of ST-MoE, mean over tokens of logsumexp(logits)^2. Experts' weights are stacked as
transformers' MixtralExperts holds them, gate_up (E, 2F, H) rows [gate | up] and down
(E, H, F): an expert axis splits dim 0.
"""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import float8, split
from ..autograd.comm import (all_to_all_v, all_to_all_v_around, copy_to_parallel, gather_from_parallel, reduce_from_parallel,
                             scatter_to_parallel)
from ..errors import GridError
from ..grid import LinePart, Span
from ..layout import Layout, gather, scatter
from ..sharding import DATA_AXES, group_order, place, placement_of, present_axes, values


class Scoring(enum.Enum):
    """How the router turns logits into expert scores."""
    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE: a distribution over the experts
    SIGMOID = "sigmoid"  # DeepSeek-V3 (§2.1.2, eq. 15): each expert's affinity on its own


@dataclass(frozen=True)
class MoE:
    """What a sparse MLP computes. experts: routed experts; top_k: experts per token; ffn: each
    expert's hidden width; normalize: renormalise the k weights to sum to 1 (Mixtral);
    capacity_factor: None for dropless; aux_coef, z_coef: the coefficients of the
    load-balancing and router z losses; shared_ffn: the hidden width of the always-on shared
    expert (Qwen2-MoE, DeepSeek; None: none), shared_gate: its output scaled by
    sigmoid(w . x) per token (Qwen2-MoE's shared_expert_gate); router_fp32: the softmax and
    the k weights in float32 whatever the activations' dtype (transformers' and Megatron's
    routers; False: in theirs, float32 at least).

    DeepSeek-V3's router (§2.1.2): scoring SIGMOID; scale: the routed experts' weights times this
    (routed_scaling_factor); groups, topk_groups: group-limited routing (a token's experts taken
    from the topk_groups groups of experts whose two best scores sum highest: node-limited
    routing when a group is a node's experts); expert_bias: a per-expert bias added to the scores
    for the choice only (auxiliary-loss-free balancing), moved by bias_rate after each step
    against the step's load (update_expert_bias); seq_aux_coef: the sequence-wise balance loss
    (eq. 17-20)."""
    experts: int = 8
    top_k: int = 2
    ffn: int = 128
    normalize: bool = True
    capacity_factor: float | None = None
    aux_coef: float = 0.0
    z_coef: float = 0.0
    shared_ffn: int | None = None
    shared_gate: bool = False
    router_fp32: bool = True
    scoring: Scoring = Scoring.SOFTMAX
    scale: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    expert_bias: bool = False
    bias_rate: float = 0.0
    seq_aux_coef: float = 0.0

    def __post_init__(self):
        if not isinstance(self.scoring, Scoring):  # a checkpoint's or export's record: the value
            try:
                object.__setattr__(self, "scoring", Scoring(self.scoring))
            except ValueError:
                raise GridError(f"MoE scoring must be one of {[s.value for s in Scoring]}, got {self.scoring!r}") from None
        for name in ("experts", "top_k", "ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"MoE {name} must be a positive integer, got {v!r}")
        if self.top_k > self.experts:
            raise GridError(f"MoE top_k {self.top_k} is above the expert count {self.experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise GridError(f"MoE capacity_factor must be positive (or None: dropless), got {self.capacity_factor!r}")
        if not (self.aux_coef >= 0 and self.z_coef >= 0):
            raise GridError(f"MoE loss coefficients must be >= 0, got aux {self.aux_coef!r}, z {self.z_coef!r}")
        if self.shared_ffn is not None and (not isinstance(self.shared_ffn, int) or self.shared_ffn < 1):
            raise GridError(f"MoE shared_ffn must be a positive integer or None, got {self.shared_ffn!r}")
        if self.shared_gate and self.shared_ffn is None:
            raise GridError("MoE shared_gate needs a shared expert (shared_ffn)")
        for name in ("groups", "topk_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"MoE {name} must be a positive integer, got {v!r}")
        if self.experts % self.groups:
            raise GridError(f"MoE: {self.experts} experts do not split into {self.groups} groups")
        if self.topk_groups > self.groups:
            raise GridError(f"MoE topk_groups {self.topk_groups} is above the group count {self.groups}")
        if self.groups > 1 and self.experts // self.groups < 2:
            raise GridError(f"group-limited routing scores a group by its two best experts: {self.groups} groups of "
                            f"{self.experts} experts have {self.experts // self.groups} each")
        if self.top_k > self.topk_groups * (self.experts // self.groups):
            raise GridError(f"MoE top_k {self.top_k} is above the {self.topk_groups} group(s) x "
                            f"{self.experts // self.groups} experts a token may choose from")
        if not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise GridError(f"MoE scale (the routed scaling factor) must be positive, got {self.scale!r}")
        if not (self.bias_rate >= 0 and self.seq_aux_coef >= 0):
            raise GridError(f"MoE bias_rate and seq_aux_coef must be >= 0, got {self.bias_rate!r}, "
                            f"{self.seq_aux_coef!r}")
        if self.bias_rate and not self.expert_bias:
            raise GridError("MoE bias_rate moves the experts' bias: it needs expert_bias")

    def record(self) -> dict:
        """Its fields as a checkpoint index or an export records them (JSON: the scoring's value)."""
        return {f: (v.value if isinstance(v, enum.Enum) else v) for f, v in self.__dict__.items()}

    def capacity(self, tokens: int) -> int | None:
        """Slots each expert keeps of `tokens` tokens' top-k (None: all, dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


@dataclass
class Routing:
    """One batch's routing. weights, experts: (T, k) the kept experts' weights and ids; probs,
    logits: (T, E) the router's (float32 or wider); order: the kept slots (flat t * k + j)
    sorted by expert, a stable order; counts: (E,) slots each expert runs."""
    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    known: list | None = None  # counts as integers where known without reading them (a planned routing)
    chosen_known: list | None = None  # a planned routing's top-k counts per expert, before any drop

    def count_list(self) -> list:
        """The kept slots per expert as integers (a host sync unless the routing is planned)."""
        return self.known if self.known is not None else self.counts.tolist()

    def group_sizes(self):
        """The kept slots per expert as the grouped GEMM takes them: integers where known, else the
        tensor on the device (not read)."""
        return self.known if self.known is not None else self.counts


def _top_k(logits: torch.Tensor, moe: MoE, bias: torch.Tensor | None = None) -> tuple:
    """(scores, the top-k's scores (what a capacity ranks slots by), their weights (renormalised
    if moe.normalize, times moe.scale), their experts). bias: DeepSeek-V3's per-expert bias,
    added to the scores for the choice only (eq. 16)."""
    logits = _router_dtype(logits, moe)
    probs = torch.sigmoid(logits) if moe.scoring is Scoring.SIGMOID else torch.softmax(logits, dim=-1)
    choice = probs if bias is None else probs + bias.to(probs.dtype)
    if moe.groups > 1:  # DeepSeek-V3's group-limited routing: the best topk_groups groups by their top-2 sums
        per_group = choice.reshape(-1, moe.groups, moe.experts // moe.groups)
        best = per_group.topk(2, dim=-1).values.sum(dim=-1).topk(moe.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = per_group.masked_fill(~allowed[..., None], -torch.inf).reshape(choice.shape)
    if choice is probs:
        chosen, experts = torch.topk(probs, moe.top_k, dim=-1)
    else:
        experts = torch.topk(choice, moe.top_k, dim=-1).indices
        chosen = probs.gather(1, experts)
    # DeepSeek-V3 renormalises sigmoid scores with transformers' 1e-20 (no zero sum of sigmoids)
    top = chosen / (chosen.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring is Scoring.SIGMOID else 0)) \
        if moe.normalize else chosen
    return probs, chosen, top * moe.scale if moe.scale != 1 else top, experts


def route(logits: torch.Tensor, moe: MoE, kept=None, bias=None) -> Routing:
    """Top-k of the scores of logits per token (softmax or sigmoid, in float32 or wider, as
    transformers' and Megatron's routers; chosen with `bias` added, DeepSeek-V3's), renormalised
    if moe.normalize; the slots sorted by expert, each expert capped at moe.capacity.
    kept(probs, experts) -> (T k,) bool: which slots a capacity keeps (default kept_slots: among
    these tokens)."""
    probs, chosen, top, experts = _top_k(logits, moe, bias)
    flat = experts.reshape(-1)
    if moe.capacity_factor is None:
        order = torch.sort(flat, stable=True).indices
    else:
        order = torch.nonzero((kept or kept_slots)(chosen, experts, moe)).reshape(-1)  # token order
        order = order[torch.sort(flat[order], stable=True).indices]
    counts = torch.bincount(flat[order], minlength=moe.experts)
    return Routing(top, experts, probs, logits, order, counts)


def planned_counts(slots: int, experts: int, imbalance: float) -> list:
    """The slots per expert of a planned routing (the planner's: a meta-device recording cannot
    route): expert 0 the most loaded, `imbalance` times the mean (>= 1; 1: balanced), the others
    sharing the rest evenly."""
    if imbalance < 1 or imbalance > experts:
        raise GridError(f"expert imbalance must be between 1 (balanced) and the expert count {experts}, "
                        f"got {imbalance!r}")
    hot = slots if experts == 1 else min(slots, round(imbalance * slots / experts))
    q, r = divmod(slots - hot, max(experts - 1, 1))
    return [hot] + [q + (i < r) for i in range(experts - 1)]


def planned_route(logits: torch.Tensor, moe: MoE, imbalance: float, ranks: int = 1, bias=None) -> Routing:
    """route() with the slots' experts fixed in advance (planned_counts, every rank alike) and
    their counts known as integers: the router's kernels as route runs them, then slots in
    expert order. ranks: the ranks whose tokens a capacity is counted over (each holds this many
    tokens and routes them alike)."""
    t, k = logits.shape[0], moe.top_k
    probs, _, top, _ = _top_k(logits, moe, bias)
    counts = planned_counts(t * k, moe.experts, imbalance)
    dev = logits.device
    experts = torch.repeat_interleave(torch.arange(moe.experts, device=dev), torch.tensor(counts, device=dev),
                                      output_size=t * k).reshape(t, k)
    cap = moe.capacity(t * ranks)
    kept = counts if cap is None else [min(c, cap // ranks) for c in counts]
    starts = itertools.accumulate(counts, initial=0)
    order = torch.arange(t * k, device=dev) if cap is None else \
        torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, kept)])
    return Routing(top, experts, probs, logits, order, torch.tensor(kept, device=dev), kept, counts)


def kept_slots(chosen: torch.Tensor, experts: torch.Tensor, moe: MoE) -> torch.Tensor:
    """(T k,) bool: the slots each expert keeps under moe.capacity(T), its most probable ones
    (Megatron-Core's drop policy "probs"). Slots of equal probability that straddle an expert's
    boundary are all dropped (identical tokens, e.g. the same first token of two windows, tie
    exactly): which ones were kept would otherwise depend on the tokens' order, and so on the
    grid. chosen, experts: (T, k)."""
    flat, p = experts.reshape(-1), chosen.reshape(-1)
    by_p = torch.sort(-p, stable=True).indices  # by probability, then by expert
    order = by_p[torch.sort(flat[by_p], stable=True).indices]
    counts = torch.bincount(flat, minlength=moe.experts)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - start[flat[order]]
    cap = moe.capacity(chosen.shape[0])
    keep = rank < cap
    if not order.numel():
        return keep
    # each expert's last kept and first dropped slot (clamped where it drops none: masked below)
    at = (start + cap - 1).clamp(max=order.numel() - 1), (start + cap).clamp(max=order.numel() - 1)
    last, first_out = p[order[at[0]]], p[order[at[1]]]
    tie = (counts > cap) & (last == first_out)  # a tie across a dropping expert's boundary: above it only
    floor = torch.where(tie, last, torch.full_like(last, -torch.inf))
    return keep & (p > floor[flat])


def _router_dtype(logits: torch.Tensor, moe: MoE) -> torch.Tensor:
    narrow = logits.dtype in (torch.float16, torch.bfloat16)
    return logits.float() if moe.router_fp32 or narrow else logits


def load_balancing_loss(chosen: torch.Tensor, prob_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """Switch Transformer eq. (4)-(6) as Mixtral trains it: E sum_e f_e P_e, f_e the share of
    tokens with e among their top-k (chosen: those counts, before any capacity drop), P_e the
    mean probability of e (prob_sum: the probabilities summed over the tokens)."""
    experts = prob_sum.shape[0]
    return experts * ((chosen.to(prob_sum.dtype) / tokens) * (prob_sum / tokens)).sum()


def z_loss(r: Routing) -> torch.Tensor:
    """ST-MoE eq. (5): the mean over tokens of logsumexp(router logits)^2 (in the probabilities'
    dtype)."""
    return _lse_squared(r).sum() / r.probs.shape[0]


def _lse_squared(r: Routing) -> torch.Tensor:
    return torch.logsumexp(r.logits.to(r.probs.dtype), dim=-1).square()


def can_group(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (torch.nn.functional.grouped_mm: float32 / bf16 / fp16, rows
    and buffers 16-byte aligned; on a GPU compute capability 8.0 or newer) runs these experts."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    widths = (x.shape[-1], gate_up.shape[1], down.shape[2])
    if any(w * x.element_size() % 16 for w in widths) or any(t.data_ptr() % 16 for t in (x, gate_up, down)):
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 0)


def swiglu_experts(x: torch.Tensor, counts, gate_up: torch.Tensor, down: torch.Tensor,
                   grouped: bool | None = None, sizes: list | None = None, recipe=None) -> torch.Tensor:
    """The grouped GEMM: rows of x sorted by expert, counts[e] rows for expert e (of the experts
    gate_up, down hold: a list, or a tensor on the device, `sizes` the same as integers where the
    caller has them); each group through down_e silu(gate_e x) * (up_e x). grouped: torch's
    grouped_mm (one kernel for every expert, as transformers' default; its offsets computed on
    the device) or a loop of products over the groups (float64: needs the sizes on the host);
    None: grouped where it can run. recipe: each expert's products in float8 (gw.float8), its own
    scales from its own rows and weights, in the loop."""
    on_device = isinstance(counts, torch.Tensor)
    if recipe is None and (grouped if grouped is not None else can_group(x, gate_up, down)):
        offs = torch.cumsum(counts, 0, dtype=torch.int32) if on_device else \
            torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
        gate, up = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    outs = []
    sizes = sizes if sizes is not None else counts.tolist() if on_device else counts
    for e, rows in enumerate(torch.split(x, sizes)):
        # an expert no row reached still multiplies its (empty) rows: its weights get their (zero)
        # gradient in every micro-batch on every rank, as grouped_mm gives them, so the optimizer's
        # hooks count the same backwards everywhere and start each reduction at one point of the step
        mine = recipe if len(rows) else None  # float8 where rows came (no scale of nothing)
        gate, up = float8.linear(rows, gate_up[e], None, mine).chunk(2, dim=-1)
        outs.append(float8.linear(F.silu(gate) * up, down[e], None, mine))
    return torch.cat(outs)


class _AttachAux(torch.autograd.Function):
    """Megatron-Core's MoEAuxLossAutoScaler: the output unchanged; its backward also gives the
    auxiliary loss the gradient `scale` (1: as if added to the loss the output reaches)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.ones_like(aux) * ctx.scale, None  # the scale: a number, or fp16's on the device


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP as transformers' Mixtral / Qwen-MoE write it (a shared expert)."""

    def __init__(self, hidden: int, ffn: int, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj, self.up_proj = nn.Linear(hidden, ffn, **kw), nn.Linear(hidden, ffn, **kw)
        self.down_proj = nn.Linear(ffn, hidden, **kw)

    def forward(self, x):
        return self.out(self.inner(x))

    def inner(self, x):
        """Its first half: silu(gate x) * up x (what an overlap runs beside the dispatch)."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def out(self, h):
        """Its second half: down h (beside the combine)."""
        return self.down_proj(h)


class DenseMoE(nn.Module, split.Deferrable):
    """The sparse MLP on one process (the reference the expert-parallel block is checked
    against). Parameters as transformers names them: gate (the router, E x H), gate_up
    (E, 2F, H), down (E, H, F), shared_expert, shared_expert_gate. After each forward:
    tokens_per_expert (E,) the slots each expert ran, aux_loss the weighted auxiliary losses
    (a detached tensor, for logging; None without them); aux_grad_scale scales their gradient
    (the training step: a loss scaler's scale over the micro-batches, times the data ranks)."""

    FLOAT8 = True  # each expert's products in float8 when given a recipe (the router's stays in bf16)
    float8 = None

    def float8_dims(self) -> tuple:
        """The dimensions its float8 products take (each expert's width here and the hidden size)."""
        return (self.gate_up.shape[1], self.hidden, self.down.shape[2])

    def __init__(self, hidden: int, moe: MoE, dtype=None, device=None, experts_here: int | None = None,
                 ffn_here: int | None = None):
        """experts_here: the experts this module holds (an expert-parallel member's share);
        ffn_here: the width of each it holds (a tensor-parallel rank's share)."""
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.moe, self.hidden = moe, hidden
        here, f = experts_here or moe.experts, ffn_here or moe.ffn
        self.gate = nn.Linear(hidden, moe.experts, bias=False, **kw)
        self.gate_up = nn.Parameter(torch.empty(here, 2 * f, hidden, **kw))
        self.down = nn.Parameter(torch.empty(here, hidden, f, **kw))
        bound = 1 / math.sqrt(hidden)  # nn.Linear's default, per expert
        nn.init.uniform_(self.gate_up, -bound, bound)
        nn.init.uniform_(self.down, -1 / math.sqrt(moe.ffn), 1 / math.sqrt(moe.ffn))
        self.shared_expert = SwiGLU(hidden, moe.shared_ffn, **kw) if moe.shared_ffn else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, **kw) if moe.shared_gate else None
        self.register_buffer("tokens_per_expert", torch.zeros(here, dtype=torch.int64, device=device),
                             persistent=False)
        # the kept slots this module's tokens sent to each expert, summed until routed_tokens reads them
        self.register_buffer("routed", torch.zeros(moe.experts, dtype=torch.int64, device=device), persistent=False)
        # DeepSeek-V3's balancing bias (transformers' e_score_correction_bias): float32 or wider, in checkpoints
        wide = torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)
        self.register_buffer("expert_bias", torch.zeros(moe.experts, dtype=wide, device=device)
                             if moe.expert_bias else None)
        self.aux_loss = None
        self.aux_grad_scale = 1.0
        self.planned_imbalance = None  # plan_routing's: route by planned_route with this imbalance
        self.overlap_shared = False  # set_moe_overlap's: the shared expert computed during the dispatch

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        if self.planned_imbalance is None:
            r = route(self.gate(x), self.moe, self._kept, self.expert_bias)
        else:
            r = planned_route(self.gate(x), self.moe, self.planned_imbalance, self._token_ranks(), self.expert_bias)
            if self.moe.capacity_factor is not None:  # the ranking's gather (its kept slots are planned)
                self._gather_slots(r.weights.detach(), r.experts)
        if self.training:  # a training step's routing (validation's forwards are not counted)
            self.routed += r.counts.detach()
        side = {}

        def inner():  # the shared expert's halves, beside the dispatch and the combine where they can run
            side["h"] = self.shared_expert.inner(x)

        def outer():
            s = self.shared_expert.out(side.pop("h"))
            side["out"] = torch.sigmoid(self.shared_expert_gate(x)) * s if self.shared_expert_gate is not None else s

        overlap = self.overlap_shared and self.shared_expert is not None
        y = self._run_experts(x, r, (inner, outer) if overlap else None)  # each kept slot's expert output, in r.order
        w = r.weights.reshape(-1)[r.order].to(y.dtype)
        out = torch.zeros_like(x).index_add(0, r.order // self.moe.top_k, y * w[:, None])  # combine
        if self.shared_expert is not None:
            if "out" not in side:
                inner()
                outer()
            out = out + side["out"]
        out = self._attach_losses(out, r, shape[0] if len(shape) == 3 else 1)
        return out.reshape(shape)

    _kept = None  # route's default: a capacity among this module's tokens

    def _token_ranks(self) -> int:
        """The ranks one micro-batch's tokens are split over (a capacity's ranking spans them)."""
        return 1

    def _gather_slots(self, chosen, experts) -> tuple:
        """The slots a capacity ranks: (probabilities, experts) of the micro-batch's tokens."""
        return chosen, experts

    def _run_experts(self, x, r: Routing, during=None):
        """Dispatch (each kept slot's token, grouped by expert), the grouped GEMM. during: two
        pieces of work to run while the dispatch and the combine move (nothing moves here: the
        caller runs them after)."""
        self.tokens_per_expert = r.counts.detach()
        return self._experts(x[r.order // self.moe.top_k], r.group_sizes())

    def _experts(self, rows, counts, sizes=None):
        """The experts this module holds on their rows (counts[e] rows each, in expert order; see
        swiglu_experts)."""
        return self._swiglu(rows, counts, sizes)

    def _swiglu(self, rows, counts, sizes):
        """swiglu_experts on this module's experts; their weights' grouped products wait for W
        where the store defers now (gw.split)."""
        return split.apart(self.weight_store, lambda x, gate_up, down: swiglu_experts(x, counts, gate_up, down,
                                                                                      sizes=sizes, recipe=self.float8),
                           rows, self.gate_up, self.down)

    def _statistics(self, r: Routing) -> tuple:
        """(top-k counts per expert, probabilities summed per expert, log-sum-exp^2 summed,
        tokens) of the tokens the losses average over: this module's."""
        chosen = torch.bincount(r.experts.reshape(-1), minlength=self.moe.experts) if r.chosen_known is None else \
            torch.tensor(r.chosen_known, device=r.probs.device)
        return chosen, r.probs.sum(dim=0), _lse_squared(r).sum(), r.probs.shape[0]

    def _sequence_statistics(self, r: Routing, batch: int) -> tuple:
        """Per sequence of this module's `batch` (rows batch-major): (top-k counts per expert,
        the scores normalised over the experts summed per expert (DeepSeek-V3 eq. 19), tokens,
        sequences over which the loss is averaged)."""
        t, e = r.probs.shape[0] // batch, self.moe.experts
        # each slot counted at (its sequence, its expert); index_add, as bincount would read its size on the host
        seq = torch.arange(batch * t, device=r.experts.device).repeat_interleave(self.moe.top_k) // t
        flat = r.probs.new_zeros(batch * e).index_add_(0, seq * e + r.experts.reshape(-1),
                                                        r.probs.new_ones(r.experts.numel()))
        chosen = flat.reshape(batch, e)
        normed = r.probs / r.probs.sum(dim=-1, keepdim=True)
        return chosen, normed.reshape(batch, t, e).sum(dim=1), t, batch

    def _sequence_loss(self, r: Routing, batch: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss (eq. 17-20), averaged over the sequences:
        sum_i f_i P_i, f_i = E / (k T) x the sequence's tokens choosing i, P_i the mean normalised
        score of i over its T tokens."""
        chosen, score_sum, t, sequences = self._sequence_statistics(r, batch)
        e, k = self.moe.experts, self.moe.top_k
        return ((e / (k * t)) * chosen * (score_sum / t)).sum() / sequences

    def _attach_losses(self, out, r: Routing, batch: int = 1):
        m = self.moe
        if not (m.aux_coef or m.z_coef or m.seq_aux_coef):
            self.aux_loss = None
            return out
        aux = r.probs.new_zeros(())
        if m.aux_coef or m.z_coef:
            chosen, prob_sum, lse2, tokens = self._statistics(r)
            if m.aux_coef:
                aux = aux + m.aux_coef * load_balancing_loss(chosen, prob_sum, tokens)
            if m.z_coef:
                aux = aux + m.z_coef * lse2 / tokens
        if m.seq_aux_coef:
            aux = aux + m.seq_aux_coef * self._sequence_loss(r, batch)
        self.aux_loss = aux.detach()  # a tensor: reading it is the caller's host sync, not every step's
        return _AttachAux.apply(out, aux, self.aux_grad_scale) if torch.is_grad_enabled() else out


class ExpertParallelMoE(DenseMoE):
    """The sparse MLP with its experts split over `ep` (a grid axis, axes or LinePart): member
    i holds experts [i E/ep, (i+1) E/ep) (gate_up, down: that slice). Every rank routes its own
    tokens; the slots travel to their experts' ranks and back (GShard's dispatch and combine,
    Megatron-Core's all-to-all dispatcher): the per-expert counts first (an all-to-all), then
    the rows (all_to_all_v, sizes known on both sides). token_axes: the axes one micro-batch's
    tokens are split over; the auxiliary losses' statistics are summed over them, so the losses
    are the micro-batch's, as on one process. A capacity limit ranks each expert's slots over
    the whole micro-batch (the token axes'), so what drops does not depend on the grid
    (Megatron-Core drops among each rank's own tokens).

    Placements: the router and the shared expert are replicated, their gradients partial over
    the token axes; the experts are split over ep (dim 0), their gradients partial over the
    rest of the token axes (the ranks holding the same experts: the other part of ep's line, or
    the token axes ep does not name), so gw.reduce_gradients, clipping, the optimizers and
    sharded checkpoints need nothing of their own."""

    def __init__(self, hidden: int, moe: MoE, grid, ep, token_axes=DATA_AXES, dtype=None, device=None, tp=None,
                 sequence=False):
        """tp: an axis whose ranks hold the same tokens and split each expert's width (Megatron's
        expert tensor parallelism, as its MLP: gate and up by columns, down by rows; each
        expert's rows all-reduced over tp before they are weighted, so the router's gradient is
        whole on every tp rank). sequence: the tokens arrive as sequence shards over tp
        (Megatron's sequence parallelism): gathered before the router, this rank's shard taken
        after the combine."""
        n, t = grid.size(ep), grid.size(tp) if tp is not None else 1
        if moe.experts % n:
            raise GridError(f"{moe.experts} experts do not split over ep {n}")
        if moe.ffn % t:
            raise GridError(f"experts of width {moe.ffn} do not split over tp {t}")
        super().__init__(hidden, moe, dtype=dtype, device=device or grid.device, experts_here=moe.experts // n,
                         ffn_here=moe.ffn // t)
        self.local_experts = moe.experts // n
        self.grid, self.ep, self.ep_size = grid, ep, n
        self.tp, self.tp_size, self.sequence = (tp if t > 1 else None), t, sequence and t > 1
        self.token_axes = present_axes(grid, token_axes)
        if isinstance(ep, LinePart):
            split, copies = (ep,), (ep.complement(),)
        else:
            split = (ep,) if isinstance(ep, str) else tuple(ep)
            copies = tuple(a for a in token_axes if a not in split)
        for p in self.parameters():
            place(p, partial=token_axes)
        widths = self.tp or ()
        # gate_up's rows regrouped so each tp block holds matching gate and up rows (nn.MLP's fc1)
        place(self.gate_up, Layout(split, widths, ()), partial=copies,
              order=((moe.ffn, moe.ffn), t, 1) if self.tp else None)
        place(self.down, Layout(split, (), widths), partial=copies)

    def comm_lines(self) -> list:
        """The lines its exchange, statistics and expert tensor parallelism run over (Grid.connect items)."""
        items = [self.ep] + ([self.ep.complement()] if isinstance(self.ep, LinePart) else [])
        tokens = [self.token_axes, self.grid.reduce_line(self.token_axes)] if self.token_axes else []
        return items + tokens + ([self.tp] if self.tp else [])

    @classmethod
    def from_dense(cls, dense: DenseMoE, grid, ep, token_axes=DATA_AXES, tp=None, sequence=False):
        m = cls(dense.hidden, dense.moe, grid, ep, token_axes, dtype=dense.gate_up.dtype, device=grid.device, tp=tp,
                sequence=sequence)
        m.load_dense(dense)
        return m

    def _expert_order(self, p, device):
        """The dense rows of dim 1 a stored expert tensor holds in order (gate_up regrouped per tp
        block, as its placement's order says), or None: as they are."""
        order = placement_of(p).order
        return None if order is None else group_order(order[0], order[1], device)

    def load_dense(self, dense: DenseMoE):
        """Copy a DenseMoE's tensors: the router and shared expert whole, this rank's block of the
        experts as their placements split them (over ep, and with tp over each expert's width)."""
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.copy_(dense.expert_bias)
            for name, p in self.named_parameters():
                src = dense.get_parameter(name).detach()
                if name in ("gate_up", "down"):
                    order = self._expert_order(p, src.device)
                    src = scatter(src if order is None else src.index_select(1, order), placement_of(p).layout,
                                  self.grid)
                p.copy_(src)

    def dense_state(self, grad=False) -> dict:
        """DenseMoE's tensors (grad=True: their gradients; see nn.dense.values): the experts
        gathered as their placements split them (collective over ep and tp)."""
        pick = values(grad)
        out = {} if grad or self.expert_bias is None else {"expert_bias": self.expert_bias.clone()}
        for name, p in self.named_parameters():
            v = pick(p).detach()
            if name not in ("gate_up", "down"):
                out[name] = v.clone()
                continue
            full = gather(v, placement_of(p).layout, self.grid)
            order = self._expert_order(p, full.device)
            out[name] = full.clone() if order is None else full.index_select(1, torch.argsort(order))
        return out

    def forward(self, x):
        if not self.sequence:
            return super().forward(x)
        # (batch, sequence shard, hidden) on each tp rank: the experts run the replica's tokens
        whole = gather_from_parallel(x, self.grid, self.tp, dim=1)
        return scatter_to_parallel(super().forward(whole), self.grid, self.tp, dim=1)

    def _experts(self, rows, counts, sizes=None):
        if self.tp is None:
            return super()._experts(rows, counts, sizes)
        # Megatron's f and g around a column- then row-parallel pair: the rows' gradient summed
        # over tp, each expert output summed over tp
        y = self._swiglu(copy_to_parallel(rows, self.grid, self.tp), counts, sizes)
        return reduce_from_parallel(y, self.grid, self.tp)

    def _run_experts(self, x, r: Routing, during=None):
        if self.ep_size == 1:
            return super()._run_experts(x, r, during)
        n, e = self.ep_size, self.local_experts
        rows = x[r.order // self.moe.top_k]  # grouped by expert: by destination member, then its experts
        counts = r.counts.reshape(n, e)
        got = self.grid.all_to_all(counts.contiguous(), self.ep)  # got[j, i]: member j's rows for my expert i
        self.tokens_per_expert = got.sum(dim=0)
        if r.known is None:  # the exchange's sizes on the host, in one read (Megatron-Core's dropless dispatcher)
            sizes = torch.cat([counts.sum(dim=1), got.reshape(-1)]).tolist()
            send, got = sizes[:n], [sizes[n + j * e:n + (j + 1) * e] for j in range(n)]
        else:  # a planned routing: every member routes alike, so each sends me what I send my own experts
            mine = r.known[self.grid.index(self.ep) * e:][:e]
            send, got = [sum(r.known[j * e:(j + 1) * e]) for j in range(n)], [mine] * n
        if during is None:
            arrived = all_to_all_v(rows, self.grid, self.ep, send, [sum(g) for g in got])
        else:  # Megatron-Core's shared-expert overlap: its halves while the rows move, forward and backward
            arrived, _ = all_to_all_v_around(rows, self.grid, self.ep, send, [sum(g) for g in got], during[0])
        # member-major (j, i) blocks -> expert-major (i, j): each expert's rows contiguous
        blocks = arrived.split([c for g in got for c in g])
        by_expert = [blocks[j * e + i] for i in range(e) for j in range(n)]
        per_expert = [sum(got[j][i] for j in range(n)) for i in range(e)]
        y = self._experts(torch.cat(by_expert), self.tokens_per_expert if r.known is None else per_expert, per_expert)
        out = y.split([got[j][i] for i in range(e) for j in range(n)])
        back = torch.cat([out[i * n + j] for j in range(n) for i in range(e)])
        if during is None:
            return all_to_all_v(back, self.grid, self.ep, [sum(g) for g in got], send)
        return all_to_all_v_around(back, self.grid, self.ep, [sum(g) for g in got], send, during[1])[0]

    def _token_ranks(self) -> int:
        return self.grid.size(self.token_axes) if self.token_axes else 1

    def _kept(self, chosen, experts, moe):
        """kept_slots over the micro-batch: every data rank's slots gathered (T k values and ids
        each), ranked, and this rank's taken back."""
        keep = kept_slots(*self._gather_slots(chosen, experts), moe)
        if not self.token_axes:
            return keep
        n = chosen.numel()
        i = self.grid.index(self.token_axes)
        return keep[i * n:(i + 1) * n]

    def _gather_slots(self, chosen, experts) -> tuple:
        if not self.token_axes:
            return chosen, experts
        every = self.grid.all_gather(torch.stack([chosen.detach(), experts.to(chosen.dtype)]).contiguous(),
                                     self.token_axes, dim=1)
        return every[0], every[1].long()

    def _sequence_axes(self) -> tuple:
        """(the token axes that split each sequence, those that split the batch into sequences)."""
        along = tuple(a for a in self.token_axes if a == "sp" and self.grid.size(a) > 1)
        return along, tuple(a for a in self.token_axes if a not in along)

    def _sequence_statistics(self, r: Routing, batch: int) -> tuple:
        chosen, score_sum, t, sequences = super()._sequence_statistics(r, batch)
        # a sequence's tokens over the sequence axes (counts summed; the sums' gradient each rank's own
        # tokens': Megatron's g); the loss averaged over the sequences of every data rank
        along, across = self._sequence_axes()
        if along:
            self.grid.all_reduce(chosen, along)
            score_sum = reduce_from_parallel(score_sum, self.grid, along)
            t *= self.grid.size(along)
        return chosen, score_sum, t, sequences * (self.grid.size(across) if across else 1)

    def _sequence_loss(self, r: Routing, batch: int) -> torch.Tensor:
        loss = super()._sequence_loss(r, batch)  # this rank's sequences' part of the mean
        across = self._sequence_axes()[1]
        return reduce_from_parallel(loss, self.grid, across) if across else loss

    def _statistics(self, r: Routing) -> tuple:
        chosen, prob_sum, lse2, tokens = super()._statistics(r)
        if not self.token_axes:
            return chosen, prob_sum, lse2, tokens
        # the counts carry no gradient; the sums do, and each rank's share of their gradient is
        # its own tokens' (Megatron's g: all-reduce forward, identity backward). Every token rank
        # holds an equal share of the micro-batch (the grid splits it evenly): the total is known
        self.grid.all_reduce(chosen, self.token_axes)
        sums = reduce_from_parallel(torch.cat([prob_sum, lse2.reshape(1)]), self.grid, self.token_axes)
        return chosen, sums[:-1], sums[-1], tokens * self.grid.size(self.token_axes)


def moe_blocks(module: nn.Module) -> list:
    """The mixture-of-experts blocks of `module`, in module order (routed_tokens' rows)."""
    return [m for m in module.modules() if isinstance(m, DenseMoE)]


def set_moe_overlap(module: nn.Module, on: bool) -> None:
    """Every mixture-of-experts block of `module` computes its shared expert's first half while
    its dispatch's rows move and its second while the combine's do (their backwards while the
    reverse exchanges move), or after them."""
    for m in moe_blocks(module):
        m.overlap_shared = bool(on)


def set_aux_grad_scale(module: nn.Module, scale) -> None:
    """The gradient every mixture-of-experts block of `module` gives its auxiliary losses
    (gw.train: the loss scale over the micro-batches, times the data ranks the optimizer
    averages over)."""
    for m in moe_blocks(module):
        m.aux_grad_scale = scale


def expert_line(grid, ep: int) -> LinePart:
    """The line part of the data axes (dp x sp, sp fastest) the experts split over: blocks of ep
    consecutive ranks (Megatron's and torchtitan's expert-parallel group, carved out of the
    data-parallel ranks; the other part of the line holds the copies)."""
    return LinePart(present_axes(grid, DATA_AXES) or ("dp",), Span.WITHIN, ep)


def plan_routing(module: nn.Module, imbalance: float | None) -> None:
    """Every mixture-of-experts block of `module` routes by planned_route with this expert
    imbalance (None: by its router again): the planner's recording on the meta device, where
    the router's choices cannot be read."""
    for m in moe_blocks(module):
        m.planned_imbalance = imbalance


def routed_tokens(module: nn.Module, grid) -> torch.Tensor | None:
    """(blocks, experts): per mixture-of-experts block of `module`, in order, the slots routed to
    each expert since the last call, summed over the blocks' token axes (collective over them; a
    tensor axis that holds the same tokens counts once), on the device, unread; the blocks'
    counters restart. None without such blocks."""
    blocks = moe_blocks(module)
    if not blocks:
        return None
    counts = torch.stack([b.routed for b in blocks])
    axes = getattr(blocks[0], "token_axes", ())
    if axes:
        grid.all_reduce(counts, axes)
    for b in blocks:
        b.routed.zero_()
    return counts


def balancing_biases(module: nn.Module) -> list:
    """(name within `module`, tensor) of its blocks' balancing biases (DeepSeek-V3's): state the
    optimizer does not hold, which checkpoints keep."""
    return [(f"{name}.expert_bias" if name else "expert_bias", m.expert_bias) for name, m in module.named_modules()
            if isinstance(m, DenseMoE) and m.expert_bias is not None]


def update_expert_bias(module: nn.Module, counts: torch.Tensor | None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2): each block's expert bias moved by its
    bias_rate toward an even load, b_i += rate * sign(mean load - load_i), from `counts`
    (routed_tokens' (blocks, experts): the step's slots over the blocks' token axes, so every
    grid moves it alike). On the device, unread."""
    if counts is None:
        return
    for b, load in zip(moe_blocks(module), counts):
        if b.moe.bias_rate and b.expert_bias is not None:
            load = load.to(b.expert_bias.dtype)
            b.expert_bias += b.moe.bias_rate * torch.sign(load.mean() - load)
