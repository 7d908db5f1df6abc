"""The dense models: the GPT (GPT-2's architecture) and Llama (RMSNorm, SwiGLU, rotary
positions, grouped-query attention), written once on one process, and their configuration."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import _init
from ..documents import check_documents, document_positions
from ..errors import GridError
from ..nn.dense import BERT, GPT2, LLAMA, MLA, Activation, Arch, DenseTransformerLayer, Norm
from ..nn.moe import MoE, Scoring


# The one reader of a model config's keys: each field under gridweave's own name (to_dict:
# a checkpoint index, an export's model_config.json) or Hugging Face's (Llama's, GPT-2's).
CONFIG_KEYS = {"vocab": ("vocab", "vocab_size"), "hidden": ("hidden", "hidden_size", "n_embd"),
               "heads": ("heads", "num_attention_heads", "n_head"), "layers": ("layers", "num_hidden_layers", "n_layer"),
               "seq": ("seq", "max_position_embeddings", "n_positions"),
               "ffn_hidden": ("ffn_hidden", "intermediate_size", "n_inner"), "kv_heads": ("kv_heads", "num_key_value_heads"),
               "eps": ("eps", "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
               "tie": ("tie", "tie_word_embeddings")}
HF_FAMILY = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "llama", "qwen3_moe": "llama", "deepseek_v3": "llama",
             "gpt2": "gpt", "bert": "bert"}  # model_type -> family
FAMILIES = ("gpt", "llama", "bert")
ENCODERS = ("bert",)  # bidirectional, trained on the masked LM; the others are causal decoders
IGNORE = -100  # a target that is not predicted (the masked LM's unmasked tokens): torch's ignore_index
HF_ACTIVATION = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # GPT-2's


@dataclass(frozen=True)
class ModelConfig:
    """A model's sizes and architecture: what a checkpoint and an export record. family: "gpt"
    (learned positions, LayerNorm, GeLU, biases), "llama", or "bert" (the bidirectional encoder
    Li et al. trains: post-norm layers, the embedding's LayerNorm, the masked-LM head).
    linformer_k: Linformer's K (encoder only): keys and values projected from seq to K rows.
    moe: every layer's MLP a mixture of experts (llama only: Mixtral; a dict is read as MoE's
    fields, as a checkpoint index or export records it)."""
    family: str = "gpt"
    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    rope_theta: float = 10000.0
    eps: float | None = None
    tie: bool = False
    activation: str | None = None  # gpt: "gelu" (exact) or "gelu_tanh" (GPT-2's gelu_new)
    linformer_k: int | None = None
    moe: MoE | None = None
    qkv_bias: bool = False  # llama: biases on q, k and v (Qwen2-MoE's)
    qk_norm: bool = False  # llama: per-head RMSNorms of the queries and keys (Qwen3-MoE's)
    mla: MLA | None = None  # llama: DeepSeek's multi-head latent attention (a dict is read as MLA's fields)
    dense_layers: tuple = ()  # with moe: the layers whose MLP is dense (ffn_hidden wide; DeepSeek's first k)

    def __post_init__(self):
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoE(**self.moe))
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLA(**self.mla))
        if not isinstance(self.dense_layers, tuple):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.moe is not None and self.family != "llama":
            raise GridError(f"mixture-of-experts layers are Llama-family (Mixtral), got {self.family!r}")
        if self.family not in FAMILIES:
            raise GridError(f"model family must be one of {FAMILIES}, got {self.family!r}")
        if (self.qkv_bias or self.qk_norm) and self.family != "llama":
            raise GridError(f"qkv_bias and qk_norm are Llama-family options (Qwen's), got {self.family!r}")
        if self.linformer_k is not None and self.family not in ENCODERS:
            raise GridError(f"Linformer is not causal: it needs the encoder (--model bert), got {self.family!r}")
        for name in ("vocab", "hidden", "heads", "layers", "seq"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"model {name} must be a positive integer, got {v!r}")
        if self.mla is not None and self.family != "llama":
            raise GridError(f"multi-head latent attention is Llama-family (DeepSeek's), got {self.family!r}")
        if self.dense_layers and (self.moe is None or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.layers for i in self.dense_layers)):
            raise GridError(f"dense_layers names layers of a mixture-of-experts model (0..{self.layers - 1}), got "
                            f"{list(self.dense_layers)!r}{'' if self.moe is not None else ' without moe'}")
        if self.mla is None:  # latent attention sizes its heads itself
            if self.hidden % self.heads:
                raise GridError(f"hidden {self.hidden} does not split into {self.heads} heads")
            if (self.hidden // self.heads) % 2 and self.family == "llama":
                raise GridError(f"rotary positions need an even head size, got {self.hidden // self.heads}")
        self.arch.kv(self.heads)  # kv_heads divides heads; Linformer's K

    @property
    def arch(self) -> Arch:
        if self.family == "llama":
            return Arch(Norm.RMS, Activation.SWIGLU, self.kv_heads, float(self.rope_theta),
                        LLAMA.eps if self.eps is None else self.eps, moe=self.moe, qkv_bias=self.qkv_bias,
                        qk_norm=self.qk_norm, mla=self.mla)
        if self.family == "bert":
            return Arch(Norm.LAYER, Activation.GELU, self.kv_heads, None, BERT.eps if self.eps is None else self.eps,
                        post_norm=True, linformer=None if self.linformer_k is None else (self.linformer_k, self.seq))
        return Arch(Norm.LAYER, Activation(self.activation or "gelu"), self.kv_heads, None,
                    GPT2.eps if self.eps is None else self.eps)

    def layer_arch(self, i: int) -> Arch:
        """Layer i's block: the arch, its MLP dense where dense_layers names it."""
        arch = self.arch
        return dataclasses.replace(arch, moe=None) if i in self.dense_layers else arch

    @property
    def bias(self) -> bool:
        return self.family != "llama"

    @property
    def causal(self) -> bool:
        """Decoders attend to the past; the encoder to the whole sequence."""
        return self.family not in ENCODERS

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.family == "llama":  # Llama's 2/3 of 4h, rounded up to a multiple of 8
            return -(-8 * self.hidden // 3 // 8) * 8
        return 4 * self.hidden

    def matrix_parameters(self, embedding: bool = True, active: bool = False) -> int:
        """Parameters of the weight matrices (norms and biases left out): q, k, v, the output
        projection and the MLP per layer, and the vocab x hidden embedding (tied or not, once).
        A mixture of experts: the router, every expert (active: the top-k a token runs) and the
        shared expert with its gate."""
        h = self.hidden
        dense_mlp = h * self.ffn * (3 if self.family == "llama" else 2)
        mlp = dense_mlp
        if self.moe is not None:
            m = self.moe
            mlp = h * (m.experts + 3 * m.ffn * (m.top_k if active else m.experts) + 3 * (m.shared_ffn or 0)
                       + m.shared_gate)
        sparse = 0 if self.moe is None else self.layers - len(self.dense_layers)
        per_layer = self._attention_matrices()
        return self.layers * per_layer + sparse * mlp + (self.layers - sparse) * dense_mlp + \
            (self.vocab * h if embedding else 0)

    def _attention_matrices(self) -> int:
        """Parameters of one layer's attention matrices: q, k, v and the output projection, or
        latent attention's down and up projections (DeepSeek-V2 §2.1)."""
        h, m = self.hidden, self.mla
        if m is None:
            kv = self.arch.kv(self.heads) * (h // self.heads)
            return h * (h + 2 * kv) + h * h
        q = h * m.q_width(self.heads) if m.q_rank is None else (h + m.q_width(self.heads)) * m.q_rank
        return q + h * (m.kv_rank + m.rope) + m.kv_rank * self.heads * (m.nope + m.v) + self.heads * m.v * h

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward, no recomputation): 6 x the matrices'
        parameters plus the attention scores and values, 6 x layers x seq x (the queries' and the
        values' widths): 12 x layers x hidden x seq for multi-head attention (PaLM's MFU
        convention, Chowdhery et al. 2022, App. B)."""
        m = self.mla
        widths = 2 * self.hidden if m is None else self.heads * (m.nope + m.rope + m.v)
        return 6 * self.matrix_parameters(active=True) + 6 * self.layers * self.seq * widths

    def to_dict(self) -> dict:
        out = asdict(self)
        out["moe"] = None if self.moe is None else self.moe.record()
        out["dense_layers"] = list(self.dense_layers)
        return out

    @staticmethod
    def fields_of(d: dict) -> dict:
        """The ModelConfig fields a config dict gives (gridweave's keys or Hugging Face's; the
        ones it lacks are left out, for the caller's defaults or overrides)."""
        out = {name: d[key] for name, keys in CONFIG_KEYS.items()
               for key in [next((k for k in keys if d.get(k) is not None), None)] if key is not None}
        if "tie" in out:
            out["tie"] = bool(out["tie"])
        family = d.get("family") or HF_FAMILY.get(d.get("model_type"))
        if family:
            out["family"] = family
        # transformers 5 keeps rotary settings in rope_parameters (older: rope_theta + rope_scaling)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is not None:
            out["rope_theta"] = float(theta)
        activation = d.get("activation") or HF_ACTIVATION.get(d.get("activation_function"))
        if activation:
            out["activation"] = activation
        if d.get("model_type") == "deepseek_v3":  # latent attention, sigmoid routing, the first layers dense
            out.pop("kv_heads", None)  # its keys have every head (num_key_value_heads = heads; hf checks)
            out["mla"] = MLA(kv_rank=d["kv_lora_rank"], q_rank=d.get("q_lora_rank"), nope=d["qk_nope_head_dim"],
                             rope=d["qk_rope_head_dim"], v=d["v_head_dim"], interleave=bool(d.get("rope_interleave", True)))
            out["moe"] = MoE(experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"], ffn=d["moe_intermediate_size"],
                             normalize=bool(d.get("norm_topk_prob", True)),
                             shared_ffn=d["moe_intermediate_size"] * d.get("n_shared_experts", 1) or None,
                             scoring=Scoring.SIGMOID, scale=float(d.get("routed_scaling_factor", 1.0)),
                             groups=d.get("n_group") or 1, topk_groups=d.get("topk_group") or 1, expert_bias=True)
            out["dense_layers"] = tuple(range(min(d.get("first_k_dense_replace") or 0, out["layers"])))
        elif d.get("moe"):
            out["moe"] = d["moe"]
        elif d.get("num_local_experts") or d.get("num_experts"):  # Mixtral's, Qwen2-MoE's, Qwen3-MoE's
            shared = d.get("shared_expert_intermediate_size") or None  # Qwen2-MoE's, behind a sigmoid gate
            out["moe"] = MoE(experts=d.get("num_local_experts") or d["num_experts"], top_k=d["num_experts_per_tok"],
                             # Mixtral's intermediate_size is each expert's; Qwen's is its dense layers'
                             ffn=d.get("moe_intermediate_size") or d["intermediate_size"],
                             normalize=bool(d.get("norm_topk_prob", True)),
                             aux_coef=float(d.get("router_aux_loss_coef") or 0.0), shared_ffn=shared,
                             shared_gate=shared is not None)
        for key in ("mla", "dense_layers"):  # gridweave's own record
            if d.get(key) and key not in out:
                out[key] = d[key]
        step, only = d.get("decoder_sparse_step") or 1, d.get("mlp_only_layers") or ()
        if out.get("moe") is not None and (step > 1 or only):  # Qwen's dense layers among the sparse ones
            out["dense_layers"] = tuple(i for i in range(out["layers"]) if i in only or (i + 1) % step)
        if d.get("qkv_bias"):  # Qwen2-MoE's biases on q, k and v
            out["qkv_bias"] = True
        if d.get("qk_norm") or d.get("model_type") == "qwen3_moe":  # Qwen3's per-head norms
            out["qk_norm"] = True
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise GridError(f"unknown model config fields {sorted(unknown)}")
        return cls(**d)


class Embedding(nn.Module):
    """Token embeddings, plus learned position embeddings when the arch has no rotary ones:
    (batch, seq) ids -> (batch, seq, hidden)."""

    def __init__(self, vocab, hidden, seq, dtype=None, device=None, positions=True, norm: nn.Module | None = None):
        """norm: a LayerNorm after the sum (BERT's embedding), or None."""
        super().__init__()
        self.tok = _init.embedding(vocab, hidden, dtype=dtype, device=device)
        self.pos = _init.embedding(seq, hidden, dtype=dtype, device=device) if positions else None
        self.ln = norm

    @classmethod
    def of(cls, tok: nn.Module, pos: nn.Module | None, norm: nn.Module | None = None) -> "Embedding":
        """An Embedding of given token (e.g. vocab-parallel), position and norm modules."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.tok, m.pos, m.ln = tok, pos, norm
        return m

    def forward(self, ids, documents=None, positions=None, length=None):
        """documents: (batch, length) ids of packed documents: learned positions restart at each.
        positions: the global positions of ids' tokens in a sequence of `length` (a sequence
        shard's, Li et al. §3: each rank embeds its own L/N tokens); None: ids are the sequence."""
        x = self.tok(ids)
        if self.pos is not None:
            length = ids.shape[1] if positions is None else length
            if length > self.pos.num_embeddings:
                raise GridError(f"a sequence of {length} tokens exceeds the model's {self.pos.num_embeddings} "
                                "positions")
            pos = torch.arange(length, device=ids.device) if positions is None else positions
            if documents is not None:
                check_documents(documents, ids.shape[0], length)
                within = document_positions(documents)
                x = x + self.pos(within if positions is None else within[:, pos])
            else:
                x = x + self.pos(pos)
        return x if self.ln is None else self.ln(x)


class Head(nn.Module):
    """Final norm and the vocabulary projection. masked_lm: BERT's masked-LM head, a dense
    hidden x hidden transform and its activation before the norm, and a bias on the projection."""

    def __init__(self, vocab, hidden, dtype=None, device=None, arch: Arch = GPT2, masked_lm: bool = False):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.transform = nn.Linear(hidden, hidden, **kw) if masked_lm else None
        self.act = arch.act if masked_lm else None
        self.ln = arch.dense_norm(hidden, **kw)
        self.out = nn.Linear(hidden, vocab, bias=masked_lm, **kw)

    @classmethod
    def of(cls, ln: nn.Module, out: nn.Module, transform: nn.Module | None = None, act=None) -> "Head":
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.transform, m.act, m.ln, m.out = transform, act, ln, out
        return m

    def forward(self, x, score=None):
        """The logits; or score(features, out): the transform (masked LM) and final norm's output
        and the projection module, inside this module's call (hooks that make its parameters
        whole, as ZeRO-3's, hold for the whole of it): a fused projection and loss."""
        if self.transform is not None:
            x = self.act(self.transform(x))
        x = self.ln(x)
        return self.out(x) if score is None else score(x, self.out)


class GPT(nn.Module):
    """A decoder: embedding, `layers` pre-norm causal layers, head. GPT-2's architecture by
    default; gw.models.Llama (or config=ModelConfig(family="llama")) for Llama's; gw.models.Bert
    (family "bert") the encoder: bidirectional post-norm layers and the masked-LM head."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, dtype=None, device=None,
                 config: ModelConfig | None = None):
        super().__init__()
        cfg = config or ModelConfig("gpt", vocab, hidden, heads, layers, seq)
        self.config = cfg
        self.vocab, self.seq = cfg.vocab, cfg.seq
        arch, kw = cfg.arch, dict(dtype=dtype, device=device)
        encoder = not cfg.causal
        self.embed = Embedding(cfg.vocab, cfg.hidden, cfg.seq, positions=arch.rope_theta is None,
                               norm=arch.dense_norm(cfg.hidden, **kw) if encoder else None, **kw)
        self.layers = nn.ModuleList(DenseTransformerLayer(cfg.hidden, cfg.heads, cfg.ffn, bias=cfg.bias,
                                                          causal=cfg.causal, arch=cfg.layer_arch(i), **kw)
                                    for i in range(cfg.layers))
        self.head = Head(cfg.vocab, cfg.hidden, arch=arch, masked_lm=encoder, **kw)
        if cfg.tie:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, ids, documents=None):
        """documents: (batch, seq) ids of packed documents: attention stays within each and
        positions restart at each."""
        x = self.embed(ids, documents)
        for layer in self.layers:
            x = layer(x, documents)
        return self.head(x)

    @staticmethod
    def loss(logits, targets):
        """Mean cross-entropy over the predicted tokens (targets IGNORE are not predicted)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)

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


class Llama(GPT):
    """A Llama-family decoder: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention
    (kv_heads < heads), no biases, optionally tied embeddings."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, kv_heads=None, ffn_hidden=None,
                 rope_theta=10000.0, eps=1e-6, tie=False, dtype=None, device=None):
        super().__init__(dtype=dtype, device=device,
                         config=ModelConfig("llama", vocab, hidden, heads, layers, seq, ffn_hidden, kv_heads,
                                            rope_theta, eps, tie))


class Bert(GPT):
    """BERT's encoder for masked-LM training (Devlin et al. 2019; Li et al.'s model): learned
    positions, an embedding LayerNorm, post-norm bidirectional layers, the masked-LM head (no
    pooler); linformer_k: Linformer's self-attention (Wang et al. 2020) with K projected rows."""

    def __init__(self, vocab=256, hidden=64, heads=4, layers=4, seq=32, ffn_hidden=None, eps=None, tie=False,
                 linformer_k=None, dtype=None, device=None):
        super().__init__(dtype=dtype, device=device,
                         config=ModelConfig("bert", vocab, hidden, heads, layers, seq, ffn_hidden, eps=eps, tie=tie,
                                            linformer_k=linformer_k))


def build(config: ModelConfig, dtype=None, device=None) -> GPT:
    """The dense model of a config."""
    return GPT(dtype=dtype, device=device, config=config)
