"""Hugging Face interop: gw.models.from_hf / to_hf / save_hf against transformers' own
LlamaForCausalLM and GPT2LMHeadModel on the same weights (float64): logits, loss and every
gradient; the exported folder loads in from_pretrained; the same weights on grids; unsupported
config fields are one clear error naming the field."""
import pytest
import torch

tf = pytest.importorskip("transformers")  # CI installs it (scripts/setup.sh); the extra is optional for users

from tp_refs import rel

CPU = torch.device("cpu")
V, S = 64, 16  # the vocabulary splits over the 1-D grids' tp (no padding of HF vocabularies)


def _llama(kv=2, tie=False, **kw):
    torch.manual_seed(0)
    c = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=kv, max_position_embeddings=S, tie_word_embeddings=tie,
                       rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **kw)
    with CPU:  # transformers builds on torch's default device (poisoned to meta in the MPI run)
        return tf.LlamaForCausalLM(c).double().eval()


def _gpt2(tie=True):
    torch.manual_seed(0)
    c = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=S, tie_word_embeddings=tie,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with CPU:
        return tf.GPT2LMHeadModel(c).double().eval()


# transformers computes Llama's RMSNorm and rotary angles in float32 whatever the dtype
# (gridweave's norm keeps float64), so in float64 the two agree to float32's precision.
LLAMA_TOL, GPT2_TOL = 1e-6, 1e-10


def _compare(hf, ours, tol, aux=None):
    """aux(router_logits): the reference's auxiliary loss from transformers' per-layer router
    logits (gridweave's reaches the gradients through the layers' outputs, not the loss value)."""
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(1), device=CPU)
    out = hf(ids, labels=ids)
    logits = ours(ids)
    loss = ours.loss(logits[:, :-1], ids[:, 1:])  # HF shifts the labels inside
    # HF's loss upcasts to float32: its gradients are taken from torch's float64 loss on its logits
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    (ref if aux is None else ref + aux(hf(ids, output_router_logits=True).router_logits)).backward()
    loss.backward()
    errs = {"logits": rel(logits, out.logits), "loss": rel(loss, ref)}
    assert rel(loss, out.loss) < 1e-6
    from gridweave.models.hf import _hf_state

    theirs = dict(hf.named_parameters())
    grads = _hf_state({k: p.grad for k, p in ours.named_parameters()} |
                      ({"head.out.weight": ours.embed.tok.weight.grad} if ours.config.tie else {}), ours.config)
    for k, g in grads.items():
        errs[k] = rel(g, theirs[k].grad)
    assert max(errs.values()) < tol, {k: v for k, v in errs.items() if v >= tol}
    return errs


@pytest.mark.parametrize("kv,tie", [(2, False), (4, True), (1, False)])
def test_llama_from_hf_equals_transformers(kv, tie):
    import gridweave as gw

    hf = _llama(kv, tie)
    ours = gw.models.from_hf(hf)
    assert ours.config.family == "llama" and ours.config.kv_heads == kv and ours.config.tie == tie
    _compare(hf, ours, LLAMA_TOL)


def _mixtral(**kw):
    torch.manual_seed(0)
    c = tf.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=S, num_local_experts=4, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                         experts_implementation="eager", **kw)  # its grouped_mm has no float64
    with CPU:
        hf = tf.MixtralForCausalLM(c).double().eval()
    with torch.no_grad():  # routers away from their near-uniform start: experts of unequal load
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return hf


@pytest.mark.parametrize("coef", [0.0, 0.02])
def test_mixtral_from_hf_equals_transformers(coef):
    """Logits, loss and every gradient; the load-balancing loss (per layer, Megatron's and
    Switch's, summed over layers) against transformers' load_balancing_loss_func of each
    layer's router logits."""
    import gridweave as gw
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = _mixtral(router_aux_loss_coef=coef)
    ours = gw.models.from_hf(hf)
    assert ours.config.moe == gw.nn.MoE(experts=4, top_k=2, ffn=24, aux_coef=coef)

    def aux(router_logits):  # routed in float32, as both routers do
        return coef * sum(load_balancing_loss_func((rl.float(),), 4, 2) for rl in router_logits)

    # with the loss, the routers' gradients carry its float32 arithmetic (both routers softmax in
    # float32): float32's bound there
    _compare(hf, ours, LLAMA_TOL if not coef else 1e-5, aux=aux if coef else None)
    # the tokens each expert ran, as transformers' routers chose them
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(1), device=CPU)
    router_logits = hf(ids, output_router_logits=True).router_logits
    for layer, rl in zip(ours.layers, router_logits):
        chosen = torch.topk(torch.softmax(rl.float(), -1), 2, -1).indices
        assert layer.moe.tokens_per_expert.tolist() == torch.bincount(chosen.reshape(-1), minlength=4).tolist()


def _qwen_moe(kind, **kw):
    """transformers' Qwen2-MoE (q/k/v biases, a gated shared expert, top-k weights as the softmax
    gives them) or Qwen3-MoE (per-head q/k RMSNorms, renormalised top-k), small, float64."""
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S, num_experts=4,
                  num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  experts_implementation="eager", **kw)  # its grouped_mm has no float64
    with CPU:
        if kind == "qwen2_moe":
            hf = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(shared_expert_intermediate_size=20, **common))
        else:
            hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(norm_topk_prob=True, head_dim=8, **common))
        hf = hf.double().eval()
    with torch.no_grad():  # routers away from their near-uniform start; biases and norms away from 0 and 1
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):  # a sparse layer's router
                layer.mlp.gate.weight.normal_(0, 0.5)
            for name, p in layer.self_attn.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("kind,coef,layout", [("qwen2_moe", 0.0, {}), ("qwen2_moe", 0.02, {}), ("qwen3_moe", 0.0, {}),
                                              ("qwen3_moe", 0.02, {}), ("qwen2_moe", 0.02, {"decoder_sparse_step": 2}),
                                              ("qwen3_moe", 0.0, {"mlp_only_layers": [1]})])
def test_qwen_moe_from_hf_equals_transformers(kind, coef, layout):
    """Qwen2-MoE and Qwen3-MoE: logits, loss and every gradient (q/k/v biases, the shared expert
    and its gate, the per-head q/k norms included), with and without the load-balancing loss;
    with dense layers among the sparse ones (decoder_sparse_step 2: the first; mlp_only_layers)."""
    import gridweave as gw
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = _qwen_moe(kind, router_aux_loss_coef=coef, **layout)
    ours = gw.models.from_hf(hf)
    c = ours.config
    assert c.dense_layers == ((0,) if "decoder_sparse_step" in layout else tuple(layout.get("mlp_only_layers", ())))
    assert [hasattr(layer, "moe") for layer in ours.layers] == [i not in c.dense_layers for i in range(2)]
    if layout:  # the export is Qwen's, with its dense layers
        back = gw.models.from_hf(gw.hf.to_hf(ours))
        assert back.config == c and all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    if kind == "qwen2_moe":
        assert c.qkv_bias and not c.qk_norm
        assert c.moe == gw.nn.MoE(experts=4, top_k=2, ffn=24, normalize=False, aux_coef=coef, shared_ffn=20,
                                  shared_gate=True)
    else:
        assert c.qk_norm and not c.qkv_bias and c.moe == gw.nn.MoE(experts=4, top_k=2, ffn=24, aux_coef=coef)

    def aux(router_logits):  # both Qwen models' loss is Mixtral's function, routed in float32
        return coef * sum(load_balancing_loss_func((rl.float(),), 4, 2) for rl in router_logits)

    _compare(hf, ours, LLAMA_TOL if not coef else 1e-5, aux=aux if coef else None)
    assert gw.hf.hf_kind(c) == kind


def _deepseek(q_rank=24, interleave=True, **kw):
    """transformers' DeepSeek-V3, small, float64: latent attention (q through its latent or not),
    8 routed experts in 4 groups of which a token's 3 come from the best 2, 2 shared experts, the
    first layer dense; routers, latent norms and balancing biases away from their start."""
    torch.manual_seed(0)
    c = tf.DeepseekV3Config(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                            n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_rank,
                            qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10, n_group=4, topk_group=2,
                            num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=S,
                            rope_interleave=interleave, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                            experts_implementation="eager", **kw)  # its grouped_mm has no float64
    with CPU:
        hf = tf.DeepseekV3ForCausalLM(c).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
            elif "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return hf


@pytest.mark.parametrize("q_rank,interleave", [(24, True), (None, False)])
def test_deepseek_v3_from_hf_equals_transformers(q_rank, interleave):
    """DeepSeek-V3: latent attention (decoupled rotary keys, interleaved or halved pairs), sigmoid
    routing with the balancing bias in the choice only, group-limited top-k, the routed scaling
    factor, shared experts, a dense first layer: logits, loss and every gradient; the experts each
    layer ran are those transformers' router chose."""
    import gridweave as gw

    hf = _deepseek(q_rank, interleave)
    ours = gw.models.from_hf(hf)
    c = ours.config
    assert c.mla == gw.nn.MLA(kv_rank=16, q_rank=q_rank, nope=10, rope=8, v=12, interleave=interleave)
    assert c.moe == gw.nn.MoE(experts=8, top_k=3, ffn=12, shared_ffn=24, scoring=gw.nn.Scoring.SIGMOID, scale=2.5,
                              groups=4, topk_groups=2, expert_bias=True)
    assert c.dense_layers == (0,) and c.ffn == 40 and not hasattr(ours.layers[0], "moe")
    _compare(hf, ours, LLAMA_TOL)
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(1), device=CPU)
    with torch.no_grad():
        ours(ids)
        for hf_layer, layer in zip(hf.model.layers[1:], ours.layers[1:]):
            x = []
            hook = hf_layer.mlp.gate.register_forward_hook(lambda m, i, o: x.append(o[2]))
            hf(ids)
            hook.remove()
            chosen = torch.bincount(x[0].reshape(-1), minlength=8)
            assert layer.moe.tokens_per_expert.tolist() == chosen.tolist()
    assert gw.hf.hf_kind(c) == "deepseek_v3"


def test_the_balancing_bias_chooses_and_moves_toward_an_even_load():
    """DeepSeek-V3 §2.1.2 on one process: the bias changes which experts run, not their weights
    (the scores as the router gave them); update_expert_bias adds rate * sign(mean - load)."""
    import gridweave as gw
    from gridweave.nn.moe import DenseMoE, route, update_expert_bias

    moe = gw.nn.MoE(experts=4, top_k=1, ffn=8, scoring=gw.nn.Scoring.SIGMOID, expert_bias=True, bias_rate=0.01,
                    normalize=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 1.5, 0.0, 0.0]], dtype=torch.float64, device=CPU)
    r = route(logits, moe, bias=torch.tensor([0.0, 0.0, 0.0, 0.0], device=CPU))
    assert r.experts.reshape(-1).tolist() == [0, 1]
    r = route(logits, moe, bias=torch.tensor([-1.0, 0.0, 0.9, 0.0], device=CPU))  # expert 2 pushed up, 0 down
    assert r.experts.reshape(-1).tolist() == [2, 2]
    assert torch.equal(r.weights.reshape(-1), torch.sigmoid(logits[:, 2]))  # unbiased scores weigh
    block = DenseMoE(8, moe, dtype=torch.float64, device=CPU)
    update_expert_bias(block, torch.tensor([[6, 2, 0, 0]], device=CPU))  # mean 2: over, even, under, under
    assert block.expert_bias.tolist() == pytest.approx([-0.01, 0.0, 0.01, 0.01])
    assert "expert_bias" in block.state_dict()  # in checkpoints and exports


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_from_hf_equals_transformers(tie):
    import gridweave as gw

    hf = _gpt2(tie)
    _compare(hf, gw.models.from_hf(hf), GPT2_TOL)


# Qwen2-MoE's and Qwen3-MoE's forms of a model: its mixture of experts and attention options
QWEN = {"qwen2_moe": dict(moe=dict(experts=4, top_k=2, ffn=16, normalize=False, shared_ffn=12, shared_gate=True),
                          qkv_bias=True),
        "qwen3_moe": dict(moe=dict(experts=4, top_k=2, ffn=16), qk_norm=True)}


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_export_folder_loads_in_from_pretrained(tmp_path, family):
    import gridweave as gw
    from gridweave.hf import save_hf

    torch.manual_seed(4)
    if family == "deepseek_v3":
        moe = gw.nn.MoE(experts=4, top_k=2, ffn=16, shared_ffn=16, scoring=gw.nn.Scoring.SIGMOID, scale=1.5, groups=2,
                        topk_groups=1, expert_bias=True)
        cfg = gw.models.ModelConfig("llama", V, 32, 4, 3, S, ffn_hidden=24, moe=moe, dense_layers=(0,),
                                    mla=gw.nn.MLA(kv_rank=8, q_rank=12, nope=6, rope=4, v=10))
        ours = gw.models.build(cfg, device=CPU).double()
        for layer in ours.layers[1:]:
            layer.moe.expert_bias.normal_(0, 0.05)
    elif family == "mixtral":
        cfg = gw.models.ModelConfig("llama", V, 32, 4, 2, S, kv_heads=2, moe=gw.nn.MoE(experts=4, top_k=2, ffn=16))
        ours = gw.models.build(cfg, device=CPU).double()
    elif family in QWEN:
        cfg = gw.models.ModelConfig("llama", V, 32, 4, 2, S, kv_heads=2, **QWEN[family])
        ours = gw.models.build(cfg, device=CPU).double()
    else:
        ours = (gw.models.Llama(V, 32, 4, 2, S, kv_heads=2, ffn_hidden=40, device=CPU) if family == "llama"
                else gw.models.GPT(V, 32, 4, 2, S, device=CPU)).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_hf(ours, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    eager = {"experts_implementation": "eager"} if family in ("mixtral", "deepseek_v3", *QWEN) else {}  # grouped_mm: no float64
    with CPU:
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, **eager).eval()
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(5), device=CPU)
    tol = GPT2_TOL if family == "gpt2" else LLAMA_TOL
    assert rel(ours(ids), hf(ids).logits) < tol
    back = gw.models.from_hf(hf)
    for k, v in ours.state_dict().items():
        if family == "deepseek_v3" and k.endswith(("expert_bias", "moe.gate.weight")):
            v = v.float().to(v.dtype)  # transformers loads DeepSeek's router and bias in float32 whatever the dtype
        assert torch.equal(back.state_dict()[k], v), k
    # the model's own method is the same conversion (issue 15's model.to_hf())
    exported = ours.to_hf()
    if eager:  # the same tensors (its float64 forward would need the eager experts switched on)
        theirs = hf.state_dict()
        fp32 = ("mlp.gate.weight", "e_score_correction_bias") if family == "deepseek_v3" else ()  # as loaded
        assert all(torch.equal(v.float().to(v.dtype) if k.endswith(fp32) else v, theirs[k])
                   for k, v in exported.state_dict().items())
    else:
        assert rel(exported(ids).logits, hf(ids).logits) == 0
    # one reader of config keys: the planner reads the saved config.json as from_hf reads transformers' config
    assert gw.plan.model_from(str(tmp_path), batch=4).config == gw.hf.config_from_hf(hf.config)


def test_from_hf_config_builds_the_architecture():
    import gridweave as gw

    m = gw.models.from_hf(_llama(2).config)
    n_hf = sum(p.numel() for p in _llama(2).parameters())
    assert sum(p.numel() for p in m.parameters()) == n_hf


@pytest.mark.parametrize("field,kw", [
    ("rope_parameters.rope_type", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
    ("attention_bias", dict(attention_bias=True)),
    ("mlp_bias", dict(mlp_bias=True)),
    ("hidden_act", dict(hidden_act="gelu")),
    ("head_dim", dict(head_dim=4)),
])
def test_unsupported_llama_fields_are_a_clear_error(field, kw):
    import gridweave as gw

    torch.manual_seed(0)
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=S)
    c = tf.LlamaConfig(**{**base, **kw})
    with pytest.raises(gw.GridError, match=field.replace(".", r"\.")):
        gw.models.from_hf(c)


@pytest.mark.parametrize("field,kw", [
    ("rope_parameters.rope_type", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 4})),
    ("num_key_value_heads", dict(num_key_value_heads=2)),
    ("n_shared_experts", dict(n_shared_experts=0)),
    ("topk_groups 3 is above the group count 2", dict(n_group=2, topk_group=3)),
    ("top_k 5 is above the 1 group", dict(n_group=4, topk_group=1, num_experts_per_tok=5)),
])
def test_unsupported_deepseek_fields_are_a_clear_error(field, kw):
    import gridweave as gw

    base = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=8, q_lora_rank=None,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_group=2, topk_group=1,
                num_experts_per_tok=2, max_position_embeddings=S)
    with pytest.raises(gw.GridError, match=field.replace(".", r"\.")):
        gw.models.from_hf(tf.DeepseekV3Config(**{**base, **kw}))


def test_unsupported_gpt2_activation_and_model_type():
    import gridweave as gw

    with pytest.raises(gw.GridError, match="activation_function"):
        gw.models.from_hf(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, activation_function="relu"))
    with pytest.raises(gw.GridError, match="model_type 'roberta'"):
        gw.models.from_hf(tf.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=40))
    with pytest.raises(gw.GridError, match="hidden_act='relu'"):  # BERT is read (issue 31), its variants are not
        gw.models.from_hf(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=40, hidden_act="relu"))


def _hf_on_grid(ctx, tp_spec, sp):
    import gridweave as gw

    hf = _llama(2)
    dense = gw.models.from_hf(hf)
    grid = ctx.init(tp=gw.models.parse_tp(tp_spec), sp=sp)
    stage = gw.models.GPTStage(dense, grid, None, 0, 1)
    ids = torch.randint(0, V, (4, S), generator=torch.Generator().manual_seed(1), device=CPU)
    return rel(stage.full_logits(stage(ids)), hf(ids).logits)


@pytest.mark.parametrize("tp,sp,n", [("row:2", 1, 2), ("cube:2", 1, 8), ("square:2", 1, 4), ("subgraph:2", 2, 4),
                                     ("none", 4, 4)])
def test_hf_llama_on_grids_equals_transformers(pool, tp, sp, n):
    for err in pool.run(_hf_on_grid, n, tp, sp):
        assert err < LLAMA_TOL, err


def test_exported_special_tokens_are_the_tokenizers_or_none():
    """transformers' defaults (GPT-2's eos 50256, Llama's 1 and 2) belong to other tokenizers: the
    export carries the ids it is given, None otherwise, and refuses ids outside the vocabulary."""
    import gridweave as gw

    for family in ("gpt", "llama"):
        cfg = gw.models.ModelConfig(family, 96, 32, 4, 2, 16, kv_heads=4 if family == "llama" else None)
        none = gw.hf.hf_config(cfg)
        assert (none.bos_token_id, none.eos_token_id, none.pad_token_id) == (None, None, None)
        given = gw.hf.hf_config(cfg, {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 95})
        assert (given.bos_token_id, given.eos_token_id, given.pad_token_id) == (0, 0, 95)
        with pytest.raises(gw.GridError, match="within the vocabulary of 96"):
            gw.hf.hf_config(cfg, {"eos_token_id": 50256})
