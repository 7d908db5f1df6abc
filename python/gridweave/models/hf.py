"""Hugging Face interop (transformers is optional: pip install gridweave[hf]).

from_hf: a LlamaForCausalLM / MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM /
GPT2LMHeadModel / BertForMaskedLM (or its config) -> gridweave's dense model,
weights copied; to_hf: the dense model -> the transformers model with the same weights;
save_hf: a folder (config.json + model.safetensors) that from_pretrained loads. A config
field gridweave does not implement is a GridError naming it, never a different model.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import GridError
from ..nn.moe import Scoring
from .dense import FAMILIES, GPT, HF_ACTIVATION, HF_FAMILY, ModelConfig, build


def _transformers():
    try:
        import transformers
    except ImportError:
        raise GridError("Hugging Face interop needs transformers: pip install 'gridweave[hf]'") from None
    return transformers


def _unsupported(field, value, why):
    raise GridError(f"Hugging Face config field {field}={value!r}: {why}; gridweave does not implement it")


def _llama_config(c) -> ModelConfig:
    # transformers 5 keeps rotary settings in rope_parameters (older: rope_theta + rope_scaling)
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _unsupported("rope_parameters.rope_type", rope_type, "rope scaling")
    if getattr(c, "attention_bias", False):
        _unsupported("attention_bias", True, "attention biases")
    if getattr(c, "mlp_bias", False):
        _unsupported("mlp_bias", True, "MLP biases")
    if c.hidden_act != "silu":
        _unsupported("hidden_act", c.hidden_act, "an activation other than SwiGLU's silu")
    if getattr(c, "sliding_window", None):
        _unsupported("sliding_window", c.sliding_window, "sliding-window attention")
    head_dim = getattr(c, "head_dim", None)
    if head_dim is not None and head_dim * c.num_attention_heads != c.hidden_size:
        _unsupported("head_dim", head_dim, "a head size other than hidden_size / num_attention_heads")
    if getattr(c, "pretraining_tp", 1) != 1:
        _unsupported("pretraining_tp", c.pretraining_tp, "split-and-sum linears")
    if getattr(c, "attention_dropout", 0.0):
        _unsupported("attention_dropout", c.attention_dropout, "dropout")
    return ModelConfig(**ModelConfig.fields_of(c.to_dict()))


def _gpt2_config(c) -> ModelConfig:
    if c.activation_function not in HF_ACTIVATION:
        _unsupported("activation_function", c.activation_function, "an activation other than GeLU")
    for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(c, field, False):
            _unsupported(field, True, "a GPT-2 variant")
    if not getattr(c, "scale_attn_weights", True):
        _unsupported("scale_attn_weights", False, "unscaled attention")
    drop = [f for f in ("resid_pdrop", "embd_pdrop", "attn_pdrop") if getattr(c, f, 0.0)]
    if drop:  # inference is the same model; training here has no dropout (as Llama's recipes)
        warnings.warn(f"GPT-2 config {', '.join(f'{f}={getattr(c, f)}' for f in drop)}: gridweave trains without "
                      "dropout (evaluation is unchanged)", stacklevel=3)
    return ModelConfig(**ModelConfig.fields_of(c.to_dict()))


def _bert_config(c) -> ModelConfig:
    if c.hidden_act != "gelu":
        _unsupported("hidden_act", c.hidden_act, "an activation other than BERT's exact GeLU")
    if getattr(c, "position_embedding_type", "absolute") != "absolute":
        _unsupported("position_embedding_type", c.position_embedding_type, "relative positions")
    if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
        _unsupported("is_decoder", True, "BERT as a decoder")
    drop = [f for f in ("hidden_dropout_prob", "attention_probs_dropout_prob") if getattr(c, f, 0.0)]
    if drop:  # inference is the same model; gridweave trains without dropout
        warnings.warn(f"BERT config {', '.join(f'{f}={getattr(c, f)}' for f in drop)}: gridweave trains without "
                      "dropout (evaluation is unchanged)", stacklevel=3)
    return ModelConfig(**ModelConfig.fields_of(c.to_dict()))


def _mixtral_config(c) -> ModelConfig:
    if getattr(c, "router_jitter_noise", 0.0):
        _unsupported("router_jitter_noise", c.router_jitter_noise, "router jitter")
    return _llama_config(c)


def _qwen_moe_config(c) -> ModelConfig:
    """Qwen2-MoE's (q/k/v biases, a gated shared expert) and Qwen3-MoE's (per-head q/k norms):
    dense layers where mlp_only_layers names them or decoder_sparse_step skips them, no sliding
    window."""
    if getattr(c, "use_sliding_window", False):
        _unsupported("use_sliding_window", True, "sliding-window attention")
    c = c.__class__.from_dict({**c.to_dict(), "sliding_window": None})  # unused unless use_sliding_window
    return _llama_config(c)


def _deepseek_config(c) -> ModelConfig:
    """DeepSeek-V3's (DeepseekV3ForCausalLM): latent attention, sigmoid routing with its balancing
    bias, group-limited top-k, shared experts, the first layers dense. Its multi-token prediction
    layers are not part of transformers' model (nor of this one)."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _unsupported("rope_parameters.rope_type", rope_type, "rope scaling (YaRN's frequencies and softmax scale)")
    for field, why in (("attention_bias", "attention biases"), ("attention_dropout", "dropout")):
        if getattr(c, field, False):
            _unsupported(field, getattr(c, field), why)
    if c.hidden_act != "silu":
        _unsupported("hidden_act", c.hidden_act, "an activation other than SwiGLU's silu")
    if getattr(c, "pretraining_tp", 1) != 1:
        _unsupported("pretraining_tp", c.pretraining_tp, "split-and-sum linears")
    if c.num_key_value_heads != c.num_attention_heads:
        _unsupported("num_key_value_heads", c.num_key_value_heads, "latent attention with grouped key/value heads")
    if not c.n_shared_experts:
        _unsupported("n_shared_experts", c.n_shared_experts, "DeepSeek's MoE without a shared expert")
    return ModelConfig(**ModelConfig.fields_of(c.to_dict()))


def config_from_hf(c) -> ModelConfig:
    kind = getattr(c, "model_type", None)
    if kind == "deepseek_v3":
        return _deepseek_config(c)
    if kind == "llama":
        return _llama_config(c)
    if kind == "mixtral":
        return _mixtral_config(c)
    if kind in ("qwen2_moe", "qwen3_moe"):
        return _qwen_moe_config(c)
    if kind == "gpt2":
        return _gpt2_config(c)
    if kind == "bert":
        return _bert_config(c)
    raise GridError(f"Hugging Face model_type {kind!r}: gridweave reads 'llama', 'mixtral', 'qwen2_moe', 'qwen3_moe', "
                    "'deepseek_v3', 'gpt2' and 'bert'")


# One name table per family, read both ways: our name -> transformers' name(s). A layer
# tensor with several HF names is their concatenation along rows (q|k|v, gate|up).
_TOP = {"llama": {"embed.tok.weight": "model.embed_tokens.weight", "head.ln.weight": "model.norm.weight",
                  "head.out.weight": "lm_head.weight"},
        "gpt": {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
                "head.ln.weight": "transformer.ln_f.weight", "head.ln.bias": "transformer.ln_f.bias",
                "head.out.weight": "lm_head.weight"},
        # BertForMaskedLM; its segment embedding of type 0 is folded into the positions (_our_state)
        "bert": {"embed.tok.weight": "bert.embeddings.word_embeddings.weight",
                 "embed.pos.weight": "bert.embeddings.position_embeddings.weight",
                 "embed.ln.weight": "bert.embeddings.LayerNorm.weight", "embed.ln.bias": "bert.embeddings.LayerNorm.bias",
                 "head.transform.weight": "cls.predictions.transform.dense.weight",
                 "head.transform.bias": "cls.predictions.transform.dense.bias",
                 "head.ln.weight": "cls.predictions.transform.LayerNorm.weight",
                 "head.ln.bias": "cls.predictions.transform.LayerNorm.bias",
                 "head.out.weight": "cls.predictions.decoder.weight", "head.out.bias": "cls.predictions.decoder.bias"}}
_BERT_LAYER = {"ln1": ["attention.output.LayerNorm"], "qkv": ["attention.self.query", "attention.self.key",
                                                               "attention.self.value"],
               "proj": ["attention.output.dense"], "ln2": ["output.LayerNorm"], "fc1": ["intermediate.dense"],
               "fc2": ["output.dense"]}
_GPT2_LAYER = {"ln_1": "ln1", "attn.c_attn": "qkv", "attn.c_proj": "proj", "ln_2": "ln2", "mlp.c_fc": "fc1",
               "mlp.c_proj": "fc2"}
_LAYER = {"llama": {"ln1.weight": ["input_layernorm.weight"], "ln2.weight": ["post_attention_layernorm.weight"],
                    "qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                    "proj.weight": ["self_attn.o_proj.weight"],
                    "fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                    "fc2.weight": ["mlp.down_proj.weight"]},
          "gpt": {f"{ours}.{k}": [f"{theirs}.{k}"] for theirs, ours in _GPT2_LAYER.items() for k in ("weight", "bias")},
          "bert": {f"{ours}.{k}": [f"{t}.{k}" for t in theirs] for ours, theirs in _BERT_LAYER.items()
                   for k in ("weight", "bias")}}
# transformers' MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock (version 5:
# experts stacked as ours are), and Qwen2-MoE's gated shared expert
_MOE_LAYER = {"moe.gate.weight": ["mlp.gate.weight"], "moe.gate_up": ["mlp.experts.gate_up_proj"],
              "moe.down": ["mlp.experts.down_proj"]}
_SHARED_LAYER = {f"moe.shared_expert.{p}.weight": [f"mlp.shared_expert.{p}.weight"]
                 for p in ("gate_proj", "up_proj", "down_proj")} | \
    {"moe.shared_expert_gate.weight": ["mlp.shared_expert_gate.weight"]}
_QWEN_ATTENTION = {"qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]}
_QK_NORMS = {"q_norm": ["self_attn.q_norm.weight"], "k_norm": ["self_attn.k_norm.weight"]}
# transformers' DeepseekV3Attention (latent attention) and DeepseekV3MoE (shared experts unGated, the
# router's balancing bias a buffer)
_MLA = {"mla.kv_down.weight": ["self_attn.kv_a_proj_with_mqa.weight"],
        "mla.kv_norm.weight": ["self_attn.kv_a_layernorm.weight"], "mla.kv_up.weight": ["self_attn.kv_b_proj.weight"],
        "mla.proj.weight": ["self_attn.o_proj.weight"]}
_MLA_Q = {None: {"mla.q.weight": ["self_attn.q_proj.weight"]},
          "latent": {"mla.q_down.weight": ["self_attn.q_a_proj.weight"],
                     "mla.q_norm.weight": ["self_attn.q_a_layernorm.weight"],
                     "mla.q_up.weight": ["self_attn.q_b_proj.weight"]}}
_DEEPSEEK_MOE = {**_MOE_LAYER, "moe.expert_bias": ["mlp.gate.e_score_correction_bias"],
                 **{f"moe.shared_expert.{p}.weight": [f"mlp.shared_experts.{p}.weight"]
                    for p in ("gate_proj", "up_proj", "down_proj")}}
_LAYER_PREFIX = {"llama": "model.layers.{}.", "gpt": "transformer.h.{}.", "bert": "bert.encoder.layer.{}."}
_SEGMENTS = "bert.embeddings.token_type_embeddings.weight"


def hf_kind(cfg: ModelConfig) -> str:
    """The transformers model_type a model is written as: Mixtral for a mixture of experts with
    renormalised top-k and nothing else; Qwen3-MoE with per-head q/k norms; Qwen2-MoE with q/k/v
    biases, a gated shared expert or top-k weights as the softmax gave them; else the family's.
    A model none of them holds is a GridError."""
    if cfg.mla is not None:
        m = cfg.moe
        deepseek = m is not None and m.scoring is Scoring.SIGMOID and m.expert_bias and m.shared_ffn and \
            not m.shared_gate and m.shared_ffn % m.ffn == 0 and m.capacity_factor is None and \
            cfg.dense_layers == tuple(range(len(cfg.dense_layers))) and not cfg.tie
        if not deepseek:
            raise GridError("transformers' latent-attention model is DeepSeek-V3's: sigmoid routing with the "
                            "balancing bias, ungated shared experts (a multiple of the experts' width), no capacity, "
                            f"the dense layers first, untied: {cfg} has no Hugging Face form")
        return "deepseek_v3"
    if cfg.moe is None and not (cfg.qkv_bias or cfg.qk_norm):
        return {"llama": "llama", "gpt": "gpt2", "bert": "bert"}[cfg.family]
    m = cfg.moe
    if m is not None and (m.scoring is not Scoring.SOFTMAX or m.scale != 1 or m.groups > 1 or m.expert_bias):
        raise GridError(f"Mixtral and Qwen-MoE route by softmax: {cfg} has no Hugging Face form")
    if m is None or m.capacity_factor is not None or (m.shared_ffn and not m.shared_gate):
        raise GridError(f"transformers' mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) have no capacity "
                        f"limit and gate any shared expert; dense Qwen layers are not read here: {cfg} has no Hugging "
                        "Face form")
    if cfg.qk_norm:
        if cfg.qkv_bias or m.shared_ffn:
            raise GridError("Qwen3-MoE has no q/k/v biases and no shared expert: a model with qk_norm and those has "
                            "no Hugging Face form")
        return "qwen3_moe"
    if cfg.qkv_bias or m.shared_ffn or not m.normalize or cfg.dense_layers:
        return "qwen2_moe"  # (Mixtral's layers are all sparse)
    return "mixtral"


def _layer_names(cfg: ModelConfig, i: int) -> dict:
    """Layer i's tensor names -> transformers' (the MLP's a mixture of experts' where it is one)."""
    if cfg.mla is not None:
        hf_kind(cfg)
        attention = {**_LAYER["llama"], **_MLA, **_MLA_Q[None if cfg.mla.q_rank is None else "latent"]}
        names = {k: v for k, v in attention.items() if not k.startswith(("qkv", "proj"))}
        return names if i in cfg.dense_layers else \
            {**{k: v for k, v in names.items() if not k.startswith("fc")}, **_DEEPSEEK_MOE}
    if cfg.moe is None:
        hf_kind(cfg)  # a dense model with Qwen's attention options has no form here: one clear error
        return _LAYER[cfg.family]
    dense = i in cfg.dense_layers  # Qwen's dense layers: Llama's MLP names
    names = {**{k: v for k, v in _LAYER["llama"].items() if dense or not k.startswith("fc")},
             **({} if dense else _MOE_LAYER)}
    if cfg.moe.shared_ffn and not dense:
        names.update(_SHARED_LAYER)
    if cfg.qkv_bias:
        names.update(_QWEN_ATTENTION)
    if cfg.qk_norm:
        names.update(_QK_NORMS)
    return names


def _conv1d(cfg: ModelConfig, ours: str) -> bool:
    """GPT-2's Conv1D stores a linear's weight as (in, out): transposed from ours."""
    return cfg.family == "gpt" and ours.endswith(".weight") and not ours.startswith("ln")


def _row_widths(cfg: ModelConfig, ours: str) -> list:
    """Rows of each HF tensor that one of ours concatenates."""
    return cfg.arch.qkv_widths(cfg.hidden, cfg.heads) if ours.startswith("qkv") else cfg.arch.fc1_widths(cfg.ffn)


def _our_state(sd: dict, cfg: ModelConfig) -> dict:
    """Our dense state from a transformers state_dict (a tied HF head is the embedding)."""
    top, prefix = _TOP[cfg.family], _LAYER_PREFIX[cfg.family]
    out = {ours: sd[theirs] for ours, theirs in top.items() if theirs in sd}
    out.setdefault("head.out.weight", out["embed.tok.weight"])
    if _SEGMENTS in sd:  # every token of segment 0: its embedding is a constant added to each position's
        out["embed.pos.weight"] = out["embed.pos.weight"] + sd[_SEGMENTS][0]
    for i in range(cfg.layers):
        for ours, theirs in _layer_names(cfg, i).items():
            w = torch.cat([sd[prefix.format(i) + t] for t in theirs])
            out[f"layers.{i}.{ours}"] = w.t() if _conv1d(cfg, ours) else w
    return out


def _hf_state(ours: dict, cfg) -> dict:
    """HF state from ours: HF tensors that ours concatenates (q|k|v, gate|up) are split back."""
    top, prefix = _TOP[cfg.family], _LAYER_PREFIX[cfg.family]
    out = {theirs: ours[o] for o, theirs in top.items() if not (cfg.tie and o == "head.out.weight")}
    if cfg.family == "bert":  # the segment embeddings zero: ours hold segment 0's in the positions
        out[_SEGMENTS] = ours["embed.pos.weight"].new_zeros(2, cfg.hidden)
        out["cls.predictions.bias"] = ours["head.out.bias"]  # the decoder's, where untied they are two
    for i in range(cfg.layers):
        for o, theirs in _layer_names(cfg, i).items():
            if f"layers.{i}.{o}" not in ours:  # a buffer (the balancing bias) in a state of gradients; to_hf
                continue  # checks that every tensor of the model is covered
            w = ours[f"layers.{i}.{o}"]
            w = w.t().contiguous() if _conv1d(cfg, o) else w
            parts = w.split(_row_widths(cfg, o)) if len(theirs) > 1 else [w]
            out.update({prefix.format(i) + t: part for t, part in zip(theirs, parts)})
    return out


def from_hf(model_or_config, dtype=None) -> GPT:
    tf = _transformers()
    if isinstance(model_or_config, tf.PreTrainedModel):
        hf = model_or_config
        cfg = config_from_hf(hf.config)
        sd = {k: v.detach() for k, v in hf.state_dict().items()}
        w = next(iter(sd.values()))
        model = build(cfg, dtype=dtype or w.dtype, device=w.device)
        state = _our_state(sd, cfg)
        if cfg.tie:
            state.pop("head.out.weight")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (cfg.tie and k == "head.out.weight")]
        if missing or unexpected:
            raise GridError(f"Hugging Face weights do not match the config: missing {missing}, unexpected {unexpected}")
        return model
    if isinstance(model_or_config, tf.PretrainedConfig):
        return build(config_from_hf(model_or_config), dtype=dtype)
    raise GridError(f"from_hf takes a transformers model or config, got {type(model_or_config).__name__}")


def hf_config(cfg: ModelConfig, special: dict | None = None):
    """transformers' config of `cfg`; special: the tokenizer's bos/eos/pad token ids (a decoder's
    are None without one: transformers' defaults, GPT-2's 50256 or Llama's 1 and 2, are another
    tokenizer's and may lie outside this vocabulary)."""
    tf = _transformers()
    special = special or {}
    bad = {k: v for k, v in special.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")
           or not (isinstance(v, int) and 0 <= v < cfg.vocab)}
    if bad:
        raise GridError(f"special token ids must be bos/eos/pad_token_id within the vocabulary of {cfg.vocab}: {bad}")
    ids = {k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    kind = hf_kind(cfg)
    if kind == "deepseek_v3":
        m, a = cfg.moe, cfg.mla
        return tf.DeepseekV3Config(
            **ids, vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn, moe_intermediate_size=m.ffn,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
            n_shared_experts=m.shared_ffn // m.ffn, n_routed_experts=m.experts, routed_scaling_factor=m.scale,
            kv_lora_rank=a.kv_rank, q_lora_rank=a.q_rank, qk_rope_head_dim=a.rope, v_head_dim=a.v,
            qk_nope_head_dim=a.nope, n_group=m.groups, topk_group=m.topk_groups, num_experts_per_tok=m.top_k,
            first_k_dense_replace=len(cfg.dense_layers), norm_topk_prob=m.normalize, hidden_act="silu",
            max_position_embeddings=cfg.seq, rms_norm_eps=cfg.arch.eps, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_interleave=a.interleave,
            attention_bias=False, attention_dropout=0.0)
    if cfg.moe is not None:
        m = cfg.moe
        common = dict(**ids, vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                      num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads or cfg.heads,
                      max_position_embeddings=cfg.seq, rms_norm_eps=cfg.arch.eps, tie_word_embeddings=cfg.tie,
                      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                      num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_coef, hidden_act="silu")
        if kind == "mixtral":
            return tf.MixtralConfig(**common, intermediate_size=m.ffn, num_local_experts=m.experts,
                                    router_jitter_noise=0.0, sliding_window=None)
        qwen = dict(common, intermediate_size=cfg.ffn, moe_intermediate_size=m.ffn, norm_topk_prob=m.normalize,
                    decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers), use_sliding_window=False,
                    head_dim=cfg.hidden // cfg.heads)
        if kind == "qwen3_moe":
            return tf.Qwen3MoeConfig(**qwen, num_experts=m.experts, attention_bias=False)
        return tf.Qwen2MoeConfig(**qwen, num_experts=m.experts, qkv_bias=cfg.qkv_bias,
                                 shared_expert_intermediate_size=m.shared_ffn or 0)
    if cfg.family == "llama":
        return tf.LlamaConfig(**ids, vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                              num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                              num_key_value_heads=cfg.kv_heads or cfg.heads, max_position_embeddings=cfg.seq,
                              rms_norm_eps=cfg.arch.eps, tie_word_embeddings=cfg.tie,
                              rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                              attention_bias=False, mlp_bias=False, hidden_act="silu")
    if cfg.kv_heads not in (None, cfg.heads):
        raise GridError(f"{cfg.family} has no grouped-query attention in Hugging Face: a model with kv_heads has no "
                        "Hugging Face form")
    if cfg.family == "bert":
        if cfg.linformer_k is not None:
            raise GridError("transformers has no Linformer: a bert model with linformer_k has no Hugging Face form")
        return tf.BertConfig(**{k: v for k, v in ids.items() if v is not None}, vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                             num_attention_heads=cfg.heads, intermediate_size=cfg.ffn, hidden_act="gelu",
                             max_position_embeddings=cfg.seq, type_vocab_size=2, layer_norm_eps=cfg.arch.eps,
                             tie_word_embeddings=cfg.tie, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.arch.activation.value]
    return tf.GPT2Config(**ids, vocab_size=cfg.vocab, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads,
                         n_positions=cfg.seq, n_inner=cfg.ffn, activation_function=act,
                         layer_norm_epsilon=cfg.arch.eps, tie_word_embeddings=cfg.tie,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# transformers' model class of each model_type hf_kind names
_HF_CLASS = {"llama": lambda tf: tf.LlamaForCausalLM, "gpt2": lambda tf: tf.GPT2LMHeadModel,
             "bert": lambda tf: tf.BertForMaskedLM, "mixtral": lambda tf: tf.MixtralForCausalLM,
             "qwen2_moe": lambda tf: tf.Qwen2MoeForCausalLM, "qwen3_moe": lambda tf: tf.Qwen3MoeForCausalLM,
             "deepseek_v3": lambda tf: tf.DeepseekV3ForCausalLM}


def _hf_class(cfg: ModelConfig, tf):
    return _HF_CLASS[hf_kind(cfg)](tf)


# What a Hugging Face folder holds besides its weights and tokenizer, kept by a run that starts
# from one (OUT/hf) and written back by its export.
SOURCE_FILES = ("config.json", "generation_config.json")
DECODERS = ("llama", "gpt")  # the families --init-from reads (Llama, GPT-2)


def read_config(folder, families=FAMILIES):
    """(ModelConfig, transformers' config) of a local Hugging Face model folder of one of `families`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise GridError(f"{folder} is not a Hugging Face model folder (no config.json)")
    c = _transformers().AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if HF_FAMILY.get(c.model_type) not in families:
        raise GridError(f"{folder}: a {c.model_type} model; this reads {', '.join(families)}")
    return config_from_hf(c), c


def from_pretrained(folder, dtype=torch.float32) -> GPT:
    """The dense model of a local Hugging Face folder (config.json and safetensors weights, read
    by transformers' own from_pretrained), in `dtype` on the host."""
    folder = Path(folder)
    cfg, c = read_config(folder)
    if not any(folder.glob("*.safetensors")):
        raise GridError(f"{folder} holds no safetensors weights (gridweave loads no pickled .bin)")
    tf = _transformers()
    bar = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # every rank loads: one bar each would flood the job's stderr
    try:
        with torch.device("cpu"):  # host memory, whatever torch's default device
            hf = _hf_class(cfg, tf).from_pretrained(str(folder), local_files_only=True, dtype=dtype,
                                                           use_safetensors=True)
    finally:
        if bar:
            tf.utils.logging.enable_progress_bar()
    return from_hf(hf, dtype=dtype)


def to_hf(model: GPT, special: dict | None = None, config=None):
    """The transformers model with `model`'s weights (same dtype and device), in eval mode;
    special: its tokenizer's special token ids (hf_config); config: the transformers config it was
    imported with (kept whole: fields gridweave does not model travel back unchanged)."""
    tf = _transformers()
    cfg = model.config
    if config is not None and config_from_hf(config) != cfg:
        raise GridError(f"the Hugging Face config it came from describes another model: {config_from_hf(config)} "
                        f"vs {cfg}")
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    w = ours["embed.tok.weight"]
    with torch.device(w.device):  # built where the weights are, whatever torch's default device
        hf = _hf_class(cfg, tf)(config if config is not None else hf_config(cfg, special)).to(w.dtype)
    missing, unexpected = hf.load_state_dict(_hf_state(ours, cfg), strict=False)
    missing = [k for k in missing if not (cfg.tie and k == _TOP[cfg.family]["head.out.weight"])]
    if missing or unexpected:
        raise GridError(f"internal: Hugging Face names not covered: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def save_hf(model: GPT, folder, special: dict | None = None, source=None) -> None:
    """config.json + model.safetensors (+ generation_config.json) that transformers'
    from_pretrained loads; special: the tokenizer's special token ids; source: the folder of
    SOURCE_FILES the model was imported from, whose config and generation config are written back."""
    config = read_config(source)[1] if source is not None else None
    hf = to_hf(model, special, config)
    if source is not None and (Path(source) / "generation_config.json").is_file():
        hf.generation_config = _transformers().GenerationConfig.from_pretrained(str(source), local_files_only=True)
    hf.save_pretrained(str(folder), safe_serialization=True)


# The dense model's own methods (model.to_hf(), the older name; model.save_hf(folder)),
# attached where the conversion lives: the dense module never imports this one (layering).
GPT.to_hf = to_hf
GPT.save_hf = save_hf
