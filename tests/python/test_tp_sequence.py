"""Megatron's sequence parallelism inside 1-D tensor parallelism (Korthikanti et al. 2022, §4.2.2):
gw.Row(n, sequence=True) keeps norms and residuals on sequence shards over tp and swaps f / g for
all-gather / reduce-scatter. A layer equals the dense one (float64, 1e-10, forward and backward)
alone and with dp and the sp ring, and moves the bytes the all-reduces moved (the paper: "no extra
communication"); the main job gives one process's losses."""
import pytest
import torch

from tp_refs import DEVICE, full, rel


def _layer(ctx, tp, dp, sp, sequence, causal=True):
    import gridweave as gw

    grid = ctx.init(dp=dp, sp=sp, tp=gw.Row(tp))
    torch.manual_seed(0)
    H, heads, Bt, L = 16, 4, 4, 16
    dense = gw.nn.DenseTransformerLayer(H, heads, causal=causal, dtype=torch.float64, device=DEVICE)
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=gw.Row(tp, sequence=sequence))
    x = full((Bt, L, H), 21).requires_grad_()
    y = dense(x)
    loss = y.pow(2).sum(-1).mean()
    loss.backward()
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    grid.reset_stats()
    yl = layer(xl)
    fwd = dict(grid.stats().get("tp", {}))
    # the loss over every token once: the sequence shards are distinct over tp now
    tokens = yl.shape[0] * yl.shape[1]
    axes = ("dp", "sp") + (("tp",) if sequence else ())
    local = gw.nn.global_token_mean(yl.pow(2).sum(), tokens, grid, axes)
    local.backward()
    gw.reduce_gradients(layer, grid)
    errs = {"y": rel(gw.gather(yl.detach(), layer.output_layout, grid), y),
            "dx": rel(gw.gather(xl.grad, layer.input_layout, grid), x.grad)}
    grads = layer.dense_state(grad=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    sent = fwd["sent_intra"]["bytes"] + fwd["sent_inter"]["bytes"] if fwd else 0
    return errs, sent, fwd.get("ops", 0), tuple(xl.shape)


@pytest.mark.parametrize("tp,dp,sp", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)])
def test_sequence_parallel_row_layer_matches_dense(pool, tp, dp, sp):
    for errs, _, _, shape in pool.run(_layer, tp * dp * sp, tp, dp, sp, True):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert shape[1] == 16 // (sp * tp), shape  # the layer's input: a sequence shard over sp and tp


def test_sequence_parallelism_moves_the_bytes_of_the_all_reduces(pool):
    """Per layer forward: 2 all-gathers + 2 reduce-scatters in place of 2 all-reduces, the same
    bytes (an all-reduce is a reduce-scatter and an all-gather)."""
    plain = pool.run(_layer, 4, 4, 1, 1, False)
    seq = pool.run(_layer, 4, 4, 1, 1, True)
    for (e0, b0, ops0, _), (e1, b1, ops1, _) in zip(plain, seq):
        assert max(e0.values()) < 1e-10 and max(e1.values()) < 1e-10
        assert ops0 == 2 and ops1 == 4, (ops0, ops1)
        assert b1 == b0 and b0 > 0, (b0, b1)


def test_tp_sp_needs_the_row_mode_and_a_sequence_that_splits():
    import gridweave as gw

    with pytest.raises(gw.GridError, match="tp_sp is Megatron's sequence parallelism inside 1-D"):
        gw.train.TrainConfig(tp="square:2", tp_sp=True)
    with pytest.raises(gw.GridError, match="does not split"):
        gw.train.TrainConfig(tp="row:2", tp_sp=True, hidden=32, heads=4, kv_heads=4, seq=5, batch=8, dp=1,
                             pp=1).grid_shape(2)


def _saved_bytes(module, x) -> int:
    """Bytes autograd keeps for backward during module(x): each storage once, parameters apart."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def _activation_memory(ctx, tp, sequence):
    import gridweave as gw

    grid = ctx.init(tp=gw.Row(tp))
    torch.manual_seed(0)
    H, heads, Bt, L = 64, 4, 2, 64
    dense = gw.nn.DenseTransformerLayer(H, heads, causal=True, dtype=torch.float64, device=DEVICE)
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=gw.Row(tp, sequence=sequence))
    x = full((Bt, L, H), 3)
    mine = _saved_bytes(layer, gw.scatter(x, layer.input_layout, grid).requires_grad_())
    return mine, _saved_bytes(dense, x.clone().requires_grad_())


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_divides_the_activations_by_t(pool, tp):
    """Korthikanti et al. 2022, Table 2: a layer keeps sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism alone and sbh/t (34 + 5as/h) with sequence parallelism, the dense layer's over t.
    Measured: the bytes autograd saves in one layer's forward on each rank."""
    seq = pool.run(_activation_memory, tp, tp, True)
    plain = pool.run(_activation_memory, tp, tp, False)
    for (mine, dense), (without, _) in zip(seq, plain):
        assert abs(mine * tp - dense) <= 0.05 * dense, (tp, mine, dense)
        assert mine < without, (mine, without)  # the norms' and residuals' regions were whole there
