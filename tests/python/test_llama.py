"""A Llama layer (RMSNorm, SwiGLU, rotary positions, grouped-query attention) in every tensor
mode and with sequence parallelism, against the dense layer: output, input gradient and
every parameter gradient (float64, 1e-10); kv-heads the tensor groups do not split."""
import pytest
import torch

from tp_refs import DEVICE, full, layer_errors, rel

# two shapes: 8 heads over 4 kv heads; 6 heads in groups of 3 over 2 kv heads, a sequence of 12
SHAPES = {"a": (32, 8, 4, 8, 48), "b": (24, 6, 4, 12, 40)}  # (hidden, heads, batch, seq, ffn)


def _modes(gw, n):
    return {"1d": lambda: dict(tp=gw.Row(n)), "1d+sp": lambda: dict(tp=gw.Row(n // 2), sp=2),
            "2d": lambda: dict(tp=gw.Square(2), dp=n // 4), "3d": lambda: dict(tp=gw.Cube(2)),
            "dsp": lambda: dict(tp=gw.SubGraph(2), dp=n // 2), "csub": lambda: dict(tp=gw.CSub(2), dp=n // 2),
            "sp": lambda: dict(sp=n), "dsp+sp": lambda: dict(tp=gw.SubGraph(2), sp=n // 2),
            "1d-tpsp": lambda: dict(tp=gw.Row(n, sequence=True))}


def _llama_layer(ctx, mode, kv_heads, attention, causal=True, shape="a", qwen=None):
    """qwen: Arch options of Qwen's layers (qkv_bias: q/k/v biases alone; qk_norm: per-head
    query/key RMSNorms before the rotation)."""
    import gridweave as gw

    H, HEADS, B, S, FFN = SHAPES[shape]
    grid = ctx.init(**_modes(gw, ctx.world_size)[mode]())
    torch.manual_seed(0)
    arch = gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, kv_heads=kv_heads, rope_theta=500.0, eps=1e-6,
                      **(qwen or {}))
    dense = gw.nn.DenseTransformerLayer(H, HEADS, FFN, bias=False, causal=causal, dtype=torch.float64, device=DEVICE,
                                        arch=arch)
    with torch.no_grad():
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, attention=attention)
    x = full((B, S, H), 31).requires_grad_()
    y = dense(x)
    dy = full(y.shape, 32)
    y.backward(dy)
    lay = layer.input_layout
    xl = gw.scatter(x.detach(), lay, grid).requires_grad_()
    yl = layer(xl)
    yl.backward(gw.scatter(dy, lay, grid))
    gw.reduce_gradients(layer, grid)  # each gradient summed over its placement's partial axes
    return layer_errors(layer, dense, grid, x, xl, y, yl)


@pytest.mark.parametrize("mode,n,kv", [("1d", 2, 2), ("1d", 4, 4), ("1d+sp", 4, 2), ("2d", 4, 2), ("3d", 8, 2),
                                       ("dsp", 4, 2), ("csub", 4, 2), ("sp", 4, 1), ("dsp+sp", 4, 2)])
def test_llama_layer_matches_dense(pool, mode, n, kv):
    for errs in pool.run(_llama_layer, n, mode, kv, "ring"):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


@pytest.mark.parametrize("mode,n", [("1d", 2), ("2d", 4), ("3d", 8), ("csub", 4), ("1d+sp", 4)])
def test_llama_layer_matches_dense_second_shape(pool, mode, n):
    for errs in pool.run(_llama_layer, n, mode, 2, "ring", True, "b"):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


@pytest.mark.parametrize("mode,n,attention", [("1d", 4, "ring"), ("1d+sp", 4, "ring"), ("2d", 4, "ring"),
                                              ("3d", 8, "ring"), ("dsp", 4, "ring"), ("csub", 4, "ring"),
                                              ("sp", 4, "ring"), ("1d-tpsp", 2, "ring")])
def test_qwen2_q_k_v_biases_in_every_mode(pool, mode, n, attention):
    """Qwen2's biases on q, k and v alone (the output projection and the MLP without)."""
    for errs in pool.run(_llama_layer, n, mode, 4, attention, True, "a", dict(qkv_bias=True)):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert "qkv.bias" in errs and "proj.bias" not in errs


@pytest.mark.parametrize("mode,n,attention", [("1d", 4, "ring"), ("1d+sp", 4, "ring"), ("sp", 4, "ring"),
                                              ("sp", 4, "ulysses"), ("sp", 4, "rsa"), ("1d-tpsp", 2, "ring")])
def test_qwen3_per_head_query_key_norms(pool, mode, n, attention):
    """Qwen3's RMSNorm over each query and key head before the rotation: every head's weights,
    their gradient summed over the ranks holding other heads and other tokens."""
    for errs in pool.run(_llama_layer, n, mode, 4, attention, True, "a", dict(qk_norm=True)):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert "q_norm" in errs and "k_norm" in errs


def test_per_head_norms_in_other_modes_are_one_clear_error():
    import gridweave as gw
    from gridweave.errors import GridError

    from gridweave.axes import grid_axes
    from gridweave.recorder import RecordingGrid

    arch = gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, kv_heads=2, rope_theta=500.0, qk_norm=True)
    for tp in (gw.Square(2), gw.Cube(2), gw.SubGraph(2)):  # the planner's stand-in grid: shapes, no ranks
        grid = RecordingGrid(grid_axes(1, 1, 1, tp), tp)
        with pytest.raises(GridError, match="per-head query/key norms"):
            gw.nn.TransformerLayer(32, 8, grid, mode=tp, arch=arch, bias=False)


@pytest.mark.parametrize("attention,causal", [("rsa", True), ("ring", False)])
def test_llama_rotary_positions_under_rsa_and_contiguous_ring(pool, attention, causal):
    for errs in pool.run(_llama_layer, 4, "sp", 2, attention, causal):
        assert max(errs.values()) < 1e-10, errs


def _kv_split(ctx):
    import gridweave as gw

    grid = ctx.init(tp=gw.Row(ctx.world_size))
    arch = gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, kv_heads=2, rope_theta=1e4)
    try:
        gw.nn.TransformerLayer(32, 8, grid, bias=False, arch=arch)
    except gw.GridError as e:
        return str(e)
    return None


def test_kv_heads_the_tensor_groups_do_not_split_are_a_clear_error(pool):
    for msg in pool.run(_kv_split, 4):
        assert msg and "2 key/value heads" in msg and "not replicate" in msg, msg


def test_dense_llama_layer_is_rope_gqa_rmsnorm_swiglu():
    """The dense layer against the formulas written out by hand (numpy-free torch, float64)."""
    import math

    import gridweave as gw

    torch.manual_seed(3)
    arch = gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, kv_heads=2, rope_theta=100.0, eps=1e-6)
    d = gw.nn.DenseTransformerLayer(16, 4, 24, bias=False, dtype=torch.float64, arch=arch, device="cpu")
    x = torch.randn(2, 5, 16, dtype=torch.float64, device="cpu")
    hd = 4

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(t):  # t: (b, s, n, hd); rotate pairs (i, i + hd/2) by pos * theta^(-2i/hd)
        out = t.clone()
        for pos in range(t.shape[1]):
            for i in range(hd // 2):
                a = pos * 100.0 ** (-2 * i / hd)
                c, s_ = math.cos(a), math.sin(a)
                x1, x2 = t[:, pos, :, i], t[:, pos, :, i + hd // 2]
                out[:, pos, :, i], out[:, pos, :, i + hd // 2] = x1 * c - x2 * s_, x2 * c + x1 * s_
        return out

    h = rms(x, d.ln1.weight)
    qkv = h @ d.qkv.weight.T
    q, k, v = qkv.split([16, 8, 8], -1)
    q, k, v = q.reshape(2, 5, 4, hd), k.reshape(2, 5, 2, hd), v.reshape(2, 5, 2, hd)
    q, k = rope(q), rope(k)
    att = torch.zeros(2, 5, 4, hd, dtype=torch.float64, device="cpu")
    for head in range(4):
        kv = head // 2  # query heads 0,1 share kv head 0
        sc = torch.einsum("bsd,btd->bst", q[:, :, head], k[:, :, kv]) / math.sqrt(hd)
        sc = sc.masked_fill(torch.ones(5, 5, dtype=torch.bool, device="cpu").triu(1), float("-inf"))
        att[:, :, head] = torch.einsum("bst,btd->bsd", sc.softmax(-1), v[:, :, kv])
    x1 = x + att.reshape(2, 5, 16) @ d.proj.weight.T
    g, u = (rms(x1, d.ln2.weight) @ d.fc1.weight.T).split([24, 24], -1)
    y = x1 + (torch.nn.functional.silu(g) * u) @ d.fc2.weight.T
    assert rel(d(x), y) < 1e-7  # the rotary angles are float32, as Hugging Face computes them


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_heads_go_to_the_fused_kernel_unrepeated(causal):
    """Grouped-query attention without a mask hands torch's kernel the key/value heads as they
    are (enable_gqa, as transformers' Llama does): forward and backward equal repeating them to
    the query heads (float64), and what autograd keeps for backward is smaller by the copies."""
    import gridweave as gw
    from gridweave.nn.dense import attention

    torch.manual_seed(0)
    heads, kv, d, s = 8, 2, 4, 6
    arch = gw.nn.Arch(gw.nn.Norm.RMS, gw.nn.Activation.SWIGLU, kv_heads=kv, rope_theta=100.0)
    qkv = torch.randn(2, s, (heads + 2 * kv) * d, dtype=torch.float64, device="cpu", requires_grad=True)
    grad = torch.randn(2, s, heads * d, dtype=torch.float64, device="cpu")

    def reference(t):
        q, k, v = gw.nn.dense.split_heads(t, heads, kv, arch)  # repeated to the query heads
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return o.transpose(1, 2).reshape(2, s, -1)

    saved = {}
    for name, f in (("gqa", lambda t: attention(t, heads, causal, kv, arch)), ("repeated", reference)):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage()) or t, lambda t: t):
            out = f(qkv)
        saved[name] = sum({st.data_ptr(): st.nbytes() for st in kept}.values())
        saved[name + "_out"], saved[name + "_grad"] = out, torch.autograd.grad(out, qkv, grad)[0]
    assert rel(saved["gqa_out"], saved["repeated_out"]) < 1e-12
    assert rel(saved["gqa_grad"], saved["repeated_grad"]) < 1e-12
    assert saved["gqa"] < saved["repeated"]
