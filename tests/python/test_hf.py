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


def _compare(hf, ours, tol):
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(1), device=CPU)
    out = hf(ids, labels=ids)
    logits = ours(ids)
    loss = ours.loss(logits[:, :-1], ids[:, 1:])  # HF shifts the labels inside
    # HF's loss upcasts to float32: its gradients are taken from torch's float64 loss on its logits
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    ref.backward()
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


@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_from_hf_equals_transformers(tie):
    import gridweave as gw

    hf = _gpt2(tie)
    _compare(hf, gw.models.from_hf(hf), GPT2_TOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_folder_loads_in_from_pretrained(tmp_path, family):
    import gridweave as gw
    from gridweave.hf import save_hf

    torch.manual_seed(4)
    ours = (gw.models.Llama(V, 32, 4, 2, S, kv_heads=2, ffn_hidden=40, device=CPU) if family == "llama"
            else gw.models.GPT(V, 32, 4, 2, S, device=CPU)).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_hf(ours, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    with CPU:
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(5), device=CPU)
    tol = LLAMA_TOL if family == "llama" else GPT2_TOL
    assert rel(ours(ids), hf(ids).logits) < tol
    back = gw.models.from_hf(hf)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # the model's own method is the same conversion (issue 15's model.to_hf())
    assert rel(ours.to_hf()(ids).logits, hf(ids).logits) == 0
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
