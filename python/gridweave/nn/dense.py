"""Dense single-process references, and helpers shared by the parallel modules.

A block's architecture (Arch) is apart from how it is parallelised: GPT-2 (LayerNorm, GeLU,
learned positions) or Llama (RMSNorm, SwiGLU, rotary positions, grouped-query attention).
Every parallel module reads the same Arch and the same packed-row conventions defined here:
qkv rows are [q (heads x d) | k (kv_heads x d) | v (kv_heads x d)], a SwiGLU fc1's rows are
[gate | up]; group_order() regroups them so that tensor-parallel column blocks are whole.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import _init
from ..autograd.heads import grouped_attention
from ..autograd.heads import repeat_kv as repeat_heads
from ..documents import check_documents, document_mask, document_positions
from ..errors import GridError
from ..sharding import values
from .moe import DenseMoE, MoE


class Norm(enum.Enum):
    LAYER = "layernorm"  # GPT-2: (x - mean) / std * weight + bias
    RMS = "rmsnorm"      # Llama: x / rms * weight


class Activation(enum.Enum):
    GELU = "gelu"              # exact erf GeLU
    GELU_TANH = "gelu_tanh"    # GPT-2's "gelu_new"
    SWIGLU = "swiglu"          # Llama: silu(gate) * up, fc1 packs [gate | up]


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention (DeepSeek-V2 §2.1, V3 §2.1.1): queries through a
    low-rank latent of q_rank (None: projected directly), keys and values through one shared
    latent of kv_rank (each normalised); per head, keys and queries of nope dimensions without
    positions and rope dimensions rotated (the keys' rope part one vector shared by the heads: the
    decoupled RoPE), values of v dimensions. interleave: the rope dimensions paired as (0, 1),
    (2, 3), ... (DeepSeek's checkpoints; transformers' rope_interleave) rather than halves. The
    softmax scale is (nope + rope)^-1/2."""
    kv_rank: int = 64
    q_rank: int | None = None
    nope: int = 16
    rope: int = 8
    v: int = 16
    interleave: bool = True
    eps: float = 1e-6  # the latents' RMSNorms (transformers' DeepseekV3RMSNorm default, whatever rms_norm_eps)

    def __post_init__(self):
        for name in ("kv_rank", "nope", "rope", "v") + (("q_rank",) if self.q_rank is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"MLA {name} must be a positive integer, got {v!r}")
        if self.rope % 2:
            raise GridError(f"MLA's rotary dimensions must be even, got rope={self.rope}")

    def q_width(self, heads: int) -> int:
        return heads * (self.nope + self.rope)


@dataclass(frozen=True)
class Arch:
    """What one decoder block computes. kv_heads None: as many as query heads (MHA);
    rope_theta None: no rotary positions (the model adds learned ones)."""
    norm: Norm = Norm.LAYER
    activation: Activation = Activation.GELU
    kv_heads: int | None = None
    rope_theta: float | None = None
    eps: float = 1e-5
    post_norm: bool = False  # BERT's post-LN block: x = LN(x + attn(x)), then LN(x + mlp(x))
    linformer: tuple | None = None  # (K, L): keys and values projected from L tokens to K rows (Linformer)
    moe: MoE | None = None  # the MLP a mixture of SwiGLU experts (Mixtral, Qwen-MoE)
    qkv_bias: bool = False  # biases on q, k and v alone (Qwen2's), whatever the other linears have
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotation (Qwen3's)
    mla: MLA | None = None  # DeepSeek's multi-head latent attention in place of q, k, v

    def __post_init__(self):
        if not isinstance(self.norm, Norm) or not isinstance(self.activation, Activation):
            raise GridError(f"Arch needs a gw.nn.Norm and a gw.nn.Activation, got {self.norm!r}, {self.activation!r}")
        if self.kv_heads is not None and (not isinstance(self.kv_heads, int) or self.kv_heads < 1):
            raise GridError(f"kv_heads must be a positive integer, got {self.kv_heads!r}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise GridError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.linformer is not None:
            k, length = self.linformer
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (k, length)):
                raise GridError(f"linformer must be (K, L) positive integers, got {self.linformer!r}")
            if self.rope_theta is not None:
                raise GridError("Linformer projects keys along the sequence: it has no rotary form here")
        if self.mla is not None and (self.rope_theta is None or self.linformer is not None or self.qk_norm
                                     or self.qkv_bias or self.kv_heads is not None):
            raise GridError("multi-head latent attention is DeepSeek's (rotary, its own projections and norms): "
                            "no Linformer, q/k norms, q/k/v biases or key/value head count with it")
        if self.moe is not None and (self.activation is not Activation.SWIGLU or self.post_norm):
            raise GridError("mixture-of-experts layers are Llama's (pre-norm, SwiGLU experts): use the llama family")

    def check_causal(self, causal: bool) -> None:
        """A GridError where this block cannot be causal (Linformer mixes every token's keys)."""
        if causal and self.linformer is not None:
            raise GridError("Linformer is not causal (its projections mix every token's keys and values): "
                            "use it in an encoder (causal=False, --model bert)")

    def make_lowrank(self, dtype=None, device=None) -> nn.Parameter | None:
        """Linformer's E and F of one layer, stacked (2, K, L) and shared by its heads (Wang et al.
        2020 §4, headwise sharing), Xavier-normal as the authors' code initialises them; None
        without Linformer."""
        if self.linformer is None:
            return None
        k, length = self.linformer
        w = torch.empty(2, k, length, dtype=dtype, device=device)
        _init.normal_(w, std=(2.0 / (k + length)) ** 0.5)
        return nn.Parameter(w)

    def kv(self, heads: int) -> int:
        """Key/value heads of a block with `heads` query heads (checked to divide them)."""
        kv = heads if self.kv_heads is None else self.kv_heads
        if heads % kv:
            raise GridError(f"{heads} query heads do not split into groups of {kv} key/value heads")
        return kv

    def qkv_widths(self, hidden: int, heads: int) -> list:
        """Row counts of the packed [q | k | v] projection."""
        if hidden % heads:
            raise GridError(f"hidden {hidden} does not split into {heads} heads")
        kvd = self.kv(heads) * (hidden // heads)
        return [hidden, kvd, kvd]

    def fc1_widths(self, ffn_hidden: int) -> list:
        """Row counts of the packed first MLP linear ([gate | up] for SwiGLU)."""
        return [ffn_hidden, ffn_hidden] if self.activation is Activation.SWIGLU else [ffn_hidden]

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP's nonlinearity on a (local block of the) fc1 output."""
        if self.activation is Activation.SWIGLU:
            gate, up = h.chunk(2, dim=-1)  # a local block is [gate_t | up_t] (group_order)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh" if self.activation is Activation.GELU_TANH else "none")

    def make_qk_norms(self, hidden: int, heads: int, dtype=None, device=None) -> tuple:
        """(q_norm, k_norm): the per-head RMSNorms' weights (head size each, ones) where the arch
        has them, else (None, None)."""
        if not self.qk_norm:
            return None, None
        return tuple(nn.Parameter(torch.ones(hidden // heads, dtype=dtype, device=device)) for _ in range(2))

    def dense_norm(self, hidden: int, dtype=None, device=None) -> nn.Module:
        if self.norm is Norm.RMS:
            return nn.RMSNorm(hidden, eps=self.eps, dtype=dtype, device=device)
        return nn.LayerNorm(hidden, eps=self.eps, dtype=dtype, device=device)


GPT2 = Arch()
LLAMA = Arch(Norm.RMS, Activation.SWIGLU, rope_theta=10000.0, eps=1e-6)
BERT = Arch(Norm.LAYER, Activation.GELU, eps=1e-12, post_norm=True)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """cos, sin (len(positions), head_dim) of rotary embeddings, computed in float32 as
    Hugging Face's Llama does (so a model exported there computes the same), then cast."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv  # (s,) or (b, s) positions: packed documents restart them
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (batch, heads, seq, d) with the rotate-half convention (Su et al.; HF Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_normed(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm, k_norm, eps: float) -> torch.Tensor:
    """Packed local [q | k | v] with each query and key head RMS-normalised over its d values
    (Qwen3's q_norm / k_norm, applied before the rotation); q_norm None: qkv as it is."""
    if q_norm is None:
        return qkv
    b, s, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = F.rms_norm(q.reshape(b, s, heads, d), (d,), q_norm, eps).reshape(b, s, heads * d)
    k = F.rms_norm(k.reshape(b, s, kv_heads, d), (d,), k_norm, eps).reshape(b, s, kv_heads * d)
    return torch.cat([q, k, v], dim=-1)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, arch: Arch, positions=None,
                repeat_kv: bool = True) -> tuple:
    """Packed local [q | k | v] (b, s, (heads + 2 kv_heads) d) -> q, k, v of (b, heads, s, d),
    rotated at `positions` (the tokens' global positions) when the arch has rotary embeddings.
    k and v are repeated to the query heads (grouped-query attention) unless repeat_kv is False
    (then (b, kv_heads, s, d), for a kernel that groups the heads itself)."""
    b, s, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    q, k, v = (t.reshape(b, s, n, d).transpose(1, 2)
               for t, n in zip(qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1), (heads, kv_heads, kv_heads)))
    if arch.rope_theta is not None:
        pos = torch.arange(s, device=qkv.device) if positions is None else positions
        cos, sin = rotary(pos, d, arch.rope_theta, qkv.dtype)
        if pos.dim() == 2:  # per-row positions (packed documents): broadcast over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if repeat_kv:
        k, v = repeat_heads(k, heads), repeat_heads(v, heads)
    return q, k, v


def linformer_keys(kv: torch.Tensor, lowrank: torch.Tensor) -> torch.Tensor:
    """(E K, F V): Linformer's projections (Wang et al. 2020, Eq. 7) of the stacked keys and values."""
    return torch.einsum("ekl,ebhld->ebhkd", lowrank, kv)


def linformer_attention(q, k, v, lowrank: torch.Tensor, total=None, project=linformer_keys) -> torch.Tensor:
    """Linformer (Wang et al. 2020, Eq. 7): softmax(Q (E K)^T / sqrt(d)) F V, with E, F = lowrank
    (2, K, L_local): the columns of this rank's tokens. total(t), where ranks split the sequence,
    sums the partial products E_i K_i, F_i V_i over them (Li et al. §4.3: one all-reduce).
    project: linformer_keys, or the same with E and F's gradients deferred (gw.split)."""
    kv = project(torch.stack((k, v)), lowrank)
    if total is not None:
        kv = total(kv)
    return F.scaled_dot_product_attention(q, kv[0], kv[1])


def attention(qkv: torch.Tensor, heads: int, causal: bool, kv_heads: int | None = None, arch: Arch = GPT2,
              positions=None, documents=None, lowrank=None) -> torch.Tensor:
    """Multi-head attention on a packed [q | k | v] (b, s, width) -> (b, s, heads x d); with
    `documents` (b, s) ids, each token attends within its document only, and rotary positions
    (unless given) restart at each document. lowrank: Linformer's (2, K, s) E and F."""
    if lowrank is not None:
        if documents is not None:
            raise GridError("Linformer projects the whole sequence: it does not mask packed documents")
        if lowrank.shape[-1] != qkv.shape[1]:
            raise GridError(f"this Linformer projects {lowrank.shape[-1]} tokens; the sequence has {qkv.shape[1]}")
    if documents is not None:
        check_documents(documents, *qkv.shape[:2])
        positions = document_positions(documents) if positions is None else positions
    kv_heads = heads if kv_heads is None else kv_heads
    # Grouped heads in the fused kernel (torch's enable_gqa, as transformers' Llama calls it) where
    # it groups them (grouped_attention): no repeated keys and values kept for backward, no sum
    # over the copies there (the one-process step 2-4% behind transformers'). With a mask torch
    # would fall back to its math kernel, and on CUDA float32 would keep the (s x s) scores (an
    # H100 kept 46 MB more in the main job's step): there they are repeated
    q, k, v = split_heads(qkv, heads, kv_heads, arch, positions, repeat_kv=lowrank is not None)
    if lowrank is not None:
        out = linformer_attention(q, k, v, lowrank)
    else:
        pos = torch.arange(qkv.shape[1], device=qkv.device)
        out = grouped_attention(q, k, v, causal, None if documents is None else document_mask(documents, pos, pos,
                                                                                                  causal))
    b, s = qkv.shape[:2]
    return out.transpose(1, 2).reshape(b, s, -1)


class DenseSelfAttention(nn.Module):
    """proj(attention(qkv(x))): the dense reference of SelfAttention."""

    def __init__(self, hidden: int, heads: int, bias: bool = True, causal: bool = True, dtype=None, device=None,
                 arch: Arch = GPT2):
        super().__init__()
        arch.check_causal(causal)
        self.heads, self.causal, self.arch = heads, causal, arch
        self.kv_heads = arch.kv(heads)
        self.qkv = nn.Linear(hidden, sum(arch.qkv_widths(hidden, heads)), bias=bias or arch.qkv_bias, dtype=dtype,
                             device=device)
        self.proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)
        self.lowrank = arch.make_lowrank(dtype, device)
        self.q_norm, self.k_norm = arch.make_qk_norms(hidden, heads, dtype, device)

    def forward(self, x, documents=None):
        qkv = qk_normed(self.qkv(x), self.heads, self.kv_heads, self.q_norm, self.k_norm, self.arch.eps)
        return self.proj(attention(qkv, self.heads, self.causal, self.kv_heads, self.arch, documents=documents,
                                   lowrank=self.lowrank))


def _rotated(t: torch.Tensor, positions: torch.Tensor, mla: MLA, theta: float) -> torch.Tensor:
    """t's rope part (b, h, s, rope) rotated at positions ((s,) or per row (b, s))."""
    if mla.interleave:  # pairs (0, 1), (2, 3), ... to halves: the same rotation in the rotate-half form
        t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    cos, sin = rotary(positions, mla.rope, theta, t.dtype)
    if positions.dim() == 2:  # per-row positions: broadcast over the heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return apply_rotary(t, cos, sin)


def mla_heads(q, kv, k_rope, heads: int, mla: MLA, theta: float, positions, key_positions=None) -> tuple:
    """Multi-head latent attention's queries, keys and values (DeepSeek-V2 eq. 12-19), (b, heads,
    s, d) each: q (b, s, heads (nope + rope)) the queries, kv (b, s', heads (nope + v)) the keys'
    nope parts and the values up-projected from the latent, k_rope (b, s', rope) the keys' shared
    rope part (unrotated); the rope parts rotated at `positions` (the keys' at key_positions when
    they are other tokens: a cache's)."""
    b, s = q.shape[:2]
    q = q.reshape(b, s, heads, mla.nope + mla.rope).transpose(1, 2)
    kv = kv.reshape(b, kv.shape[1], heads, mla.nope + mla.v).transpose(1, 2)
    q_nope, q_rope = q.split([mla.nope, mla.rope], dim=-1)
    k_nope, v = kv.split([mla.nope, mla.v], dim=-1)
    k_rope = _rotated(k_rope[:, None], positions if key_positions is None else key_positions, mla, theta)
    q = torch.cat([q_nope, _rotated(q_rope, positions, mla, theta)], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], dim=-1)  # one rotary key for every head
    return q, k, v


def mla_attention(q, kv, k_rope, heads: int, mla: MLA, theta: float, causal: bool, positions=None,
                  documents=None) -> torch.Tensor:
    """Multi-head latent attention's core on this rank's heads (mla_heads, then attention; packed
    documents: within each, positions restarting at each) -> (b, s, heads v)."""
    b, s = q.shape[:2]
    if documents is not None:
        check_documents(documents, b, s)
        positions = document_positions(documents) if positions is None else positions
    pos = torch.arange(s, device=q.device) if positions is None else positions
    q, k, v = mla_heads(q, kv, k_rope, heads, mla, theta, pos)
    mask = None
    if documents is not None:
        at = torch.arange(s, device=q.device)
        mask = document_mask(documents, at, at, causal)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and mask is None, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, s, heads * mla.v)


class DenseMLA(nn.Module):
    """Multi-head latent attention on one process, its tensors as transformers' DeepseekV3Attention
    holds them: q (hidden -> heads (nope + rope)) or q_down, q_norm, q_up through the q latent;
    kv_down (hidden -> kv_rank + rope: the latent and the shared rotary key), kv_norm, kv_up
    (kv_rank -> heads (nope + v)); proj (heads v -> hidden)."""

    def __init__(self, hidden: int, heads: int, mla: MLA, theta: float, causal: bool = True, dtype=None,
                 device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.heads, self.mla, self.theta, self.causal = heads, mla, theta, causal
        if mla.q_rank is None:
            self.q = nn.Linear(hidden, mla.q_width(heads), **kw)
        else:
            self.q_down = nn.Linear(hidden, mla.q_rank, **kw)
            self.q_norm = nn.RMSNorm(mla.q_rank, eps=mla.eps, dtype=dtype, device=device)
            self.q_up = nn.Linear(mla.q_rank, mla.q_width(heads), **kw)
        self.kv_down = nn.Linear(hidden, mla.kv_rank + mla.rope, **kw)
        self.kv_norm = nn.RMSNorm(mla.kv_rank, eps=mla.eps, dtype=dtype, device=device)
        self.kv_up = nn.Linear(mla.kv_rank, heads * (mla.nope + mla.v), **kw)
        self.proj = nn.Linear(heads * mla.v, hidden, **kw)

    def queries(self, x):
        return self.q(x) if self.mla.q_rank is None else self.q_up(self.q_norm(self.q_down(x)))

    def forward(self, x, documents=None):
        latent, k_rope = self.kv_down(x).split([self.mla.kv_rank, self.mla.rope], dim=-1)
        out = mla_attention(self.queries(x), self.kv_up(self.kv_norm(latent)), k_rope, self.heads, self.mla,
                            self.theta, self.causal, documents=documents)
        return self.proj(out)


class DenseMLP(nn.Module):
    """fc2(act(fc1(x))): the dense reference of MLP (fc1 packs [gate | up] for SwiGLU)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, dtype=None, device=None, arch: Arch = GPT2):
        super().__init__()
        self.arch = arch
        self.fc1 = nn.Linear(hidden, sum(arch.fc1_widths(ffn_hidden)), bias=bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x):
        return self.fc2(self.arch.act(self.fc1(x)))


class DenseTransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + proj(attn(qkv(ln1 x))), then x + fc2(act(fc1(ln2 x))).
    GPT-2 by default; arch=gw.nn.LLAMA (with bias=False) is a Llama layer; gw.nn.BERT (with
    causal=False) BERT's post-norm encoder layer: ln1(x + attn(x)), then ln2(x + mlp(x))."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int | None = None, bias: bool = True,
                 causal: bool = True, dtype=None, device=None, arch: Arch = GPT2):
        super().__init__()
        ffn_hidden = ffn_hidden or 4 * hidden
        kw = dict(dtype=dtype, device=device)
        arch.check_causal(causal)
        self.heads, self.causal, self.arch = heads, causal, arch
        self.kv_heads = arch.kv(heads)
        self.ln1 = arch.dense_norm(hidden, **kw)
        if arch.mla is None:
            self.qkv = nn.Linear(hidden, sum(arch.qkv_widths(hidden, heads)), bias=bias or arch.qkv_bias, **kw)
            self.proj = nn.Linear(hidden, hidden, bias=bias, **kw)
        else:
            self.mla = DenseMLA(hidden, heads, arch.mla, arch.rope_theta, causal, **kw)
        self.lowrank = arch.make_lowrank(**kw)
        self.q_norm, self.k_norm = arch.make_qk_norms(hidden, heads, **kw)
        self.ln2 = arch.dense_norm(hidden, **kw)
        if arch.moe is None:
            self.fc1 = nn.Linear(hidden, sum(arch.fc1_widths(ffn_hidden)), bias=bias, **kw)
            self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, **kw)
        else:
            self.moe = DenseMoE(hidden, arch.moe, **kw)
        self._ffn_hidden = ffn_hidden

    @property
    def ffn_hidden(self) -> int:
        return self._ffn_hidden

    def feed_forward(self, h):
        """The MLP: fc2(act(fc1 h)), or the mixture of experts."""
        return self.moe(h) if self.arch.moe is not None else self.fc2(self.arch.act(self.fc1(h)))

    def _attn(self, h, documents):
        if self.arch.mla is not None:
            return self.mla(h, documents)
        qkv = qk_normed(self.qkv(h), self.heads, self.kv_heads, self.q_norm, self.k_norm, self.arch.eps)
        return self.proj(attention(qkv, self.heads, self.causal, self.kv_heads, self.arch,
                                   documents=documents, lowrank=self.lowrank))

    def forward(self, x, documents=None):
        if self.arch.post_norm:
            x = self.ln1(x + self._attn(x, documents))
            return self.ln2(x + self.feed_forward(x))
        x = x + self._attn(self.ln1(x), documents)
        return x + self.feed_forward(self.ln2(x))


def dense_linear(state: dict, in_features: int, out_features: int) -> nn.Linear:
    """A torch Linear holding full tensors assembled by a parallel module's dense_state()."""
    w = state["weight"]
    lin = nn.Linear(in_features, out_features, bias="bias" in state, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(state["weight"])
        if "bias" in state:
            lin.bias.copy_(state["bias"])
    return lin


def dense_layernorm(state: dict, hidden: int, eps: float) -> nn.Module:
    """A torch LayerNorm (state has a bias) or RMSNorm (it has none) holding full tensors."""
    w = state["weight"]
    kw = dict(eps=eps, dtype=w.dtype, device=w.device)
    ln = nn.LayerNorm(hidden, **kw) if "bias" in state else nn.RMSNorm(hidden, **kw)
    with torch.no_grad():
        ln.weight.copy_(w)
        if "bias" in state:
            ln.bias.copy_(state["bias"])
    return ln


def norm_kind(dense: nn.Module) -> Norm:
    """The Norm of a torch LayerNorm / RMSNorm."""
    if isinstance(dense, nn.RMSNorm):
        return Norm.RMS
    if isinstance(dense, nn.LayerNorm):
        return Norm.LAYER
    raise GridError(f"expected a torch LayerNorm or RMSNorm, got {type(dense).__name__}")


def normalize(x: torch.Tensor, norm: Norm, eps: float, hidden: int, total) -> torch.Tensor:
    """x normalised over a hidden dim of `hidden` elements, of which x holds a slice:
    `total` sums a partial statistic over the ranks splitting it. Statistics in float32 or
    wider (half-precision inputs are upcast); the result has x's dtype."""
    xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if norm is Norm.LAYER:
        xs = xs - total(xs.sum(-1, keepdim=True)) / hidden
    var = total((xs * xs).sum(-1, keepdim=True)) / hidden
    return (xs * torch.rsqrt(var + eps)).to(x.dtype)


def linear_tensors(dense: nn.Linear, order=None):
    """(weight, bias) of a dense Linear, output rows reordered by `order` if given."""
    w, b = dense.weight.detach(), None if dense.bias is None else dense.bias.detach()
    if order is not None:
        w, b = w[order], (None if b is None else b[order])
    return w, b


class ParallelLinearBase(nn.Module):
    """from_dense / to_dense for every parallel linear; subclasses define load_dense and dense_state."""

    FLOAT8 = False  # whether its products run in float8 when given a recipe (gw.float8.convert)
    float8 = None  # the Float8Recipe its products run with (None: the parameters' dtype)
    FLOAT8_GATHER = True  # one weight: ZeRO-3 may gather it in float8 (gw.float8.gathered_weights)

    @classmethod
    def from_dense(cls, dense: nn.Linear, grid, **kw):
        kw.setdefault("dtype", dense.weight.dtype)
        m = cls(dense.in_features, dense.out_features, grid, bias=dense.bias is not None, **kw)
        m.load_dense(dense)
        return m

    def to_dense(self) -> nn.Linear:
        return dense_linear(self.dense_state(), self.in_features, self.out_features)
