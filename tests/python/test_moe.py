"""The mixture-of-experts block (issue 35) against transformers' own MoE blocks and its
load-balancing loss (float32: transformers' routers take the softmax in float32 whatever the
model's dtype), and in float64 against a per-token loop, dropless and with a capacity limit."""
import dataclasses
import math

import pytest
import torch

from gridweave.errors import GridError
from gridweave.nn.moe import DenseMoE, MoE, route, z_loss

transformers = pytest.importorskip("transformers")
DEV = "cpu"


F32 = dict(rtol=1e-5, atol=1e-5)


def mixtral_block(experts=4, top_k=2, hidden=32, ffn=16):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                        num_experts_per_tok=top_k, router_jitter_noise=0.0)
    torch.manual_seed(0)
    with torch.device(DEV):  # transformers' modules are made on the default device (poisoned in CI)
        hf = MixtralSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf


def ours_from(hf, moe: MoE):
    ours = DenseMoE(hf.experts.gate_up_proj.shape[2], moe, dtype=torch.float32, device=DEV)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.gate_up.copy_(hf.experts.gate_up_proj)
        ours.down.copy_(hf.experts.down_proj)
        if moe.shared_ffn:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared_expert, name).weight.copy_(getattr(hf.shared_expert, name).weight)
            if moe.shared_gate:
                ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return ours


def grads(module, x, extra=None):
    x = x.clone().requires_grad_(True)
    out = module(x)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=DEV).reshape(out.shape)).sum()
    if extra is not None:
        loss = loss + extra(x)
    loss.backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def test_mixtral_block_equals_transformers_forward_and_backward():
    hf = mixtral_block()
    ours = ours_from(hf, MoE(experts=4, top_k=2, ffn=16))
    x = torch.randn(3, 10, 32, dtype=torch.float32, device=DEV)
    out_hf, gx_hf, g_hf = grads(hf, x)
    out, gx, g = grads(ours, x)
    torch.testing.assert_close(out, out_hf, **F32)
    torch.testing.assert_close(gx, gx_hf, **F32)
    for ours_name, hf_name in (("gate.weight", "gate.weight"), ("gate_up", "experts.gate_up_proj"),
                               ("down", "experts.down_proj")):
        torch.testing.assert_close(g[ours_name], g_hf[hf_name], **F32)
    # the tokens each expert ran: transformers' router's choices, counted
    _, _, chosen = hf.gate(x.reshape(-1, 32))  # float32, as the block ran
    assert ours.tokens_per_expert.tolist() == torch.bincount(chosen.reshape(-1), minlength=4).tolist()


def test_qwen_moe_block_with_a_gated_shared_expert_equals_transformers():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=20, num_experts=6,
                         num_experts_per_tok=3, norm_topk_prob=False)
    torch.manual_seed(1)
    with torch.device(DEV):
        hf = Qwen2MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = ours_from(hf, MoE(experts=6, top_k=3, ffn=8, normalize=False, shared_ffn=20, shared_gate=True))
    x = torch.randn(2, 9, 24, dtype=torch.float32, device=DEV)
    out_hf, gx_hf, g_hf = grads(hf, x)
    out, gx, g = grads(ours, x)
    torch.testing.assert_close(out, out_hf, **F32)
    torch.testing.assert_close(gx, gx_hf, **F32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(g[f"shared_expert.{name}.weight"], g_hf[f"shared_expert.{name}.weight"], **F32)
    torch.testing.assert_close(g["shared_expert_gate.weight"], g_hf["shared_expert_gate.weight"], **F32)
    torch.testing.assert_close(g["gate_up"], g_hf["experts.gate_up_proj"], **F32)


def test_auxiliary_losses_are_transformers_and_st_moe_and_back_propagate_with_the_output():
    """The load-balancing loss is transformers' load_balancing_loss_func of the layer's router
    logits; the z-loss ST-MoE's mean logsumexp^2 (numpy); both reach the router's gradient
    through the output's backward as if added to the loss."""
    import numpy as np
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = mixtral_block(experts=5, top_k=2)
    aux, zc = 0.02, 0.003
    ours = ours_from(hf, MoE(experts=5, top_k=2, ffn=16, aux_coef=aux, z_coef=zc))
    x = torch.randn(4, 7, 32, dtype=torch.float32, device=DEV)

    def reference_losses(x):
        logits = hf.gate(x.reshape(-1, 32))[0]
        lse = torch.logsumexp(logits, dim=-1)
        return aux * load_balancing_loss_func((logits,), 5, 2) + zc * (lse * lse).mean()

    out_hf, gx_hf, g_hf = grads(hf, x, extra=reference_losses)
    out, gx, g = grads(ours, x)
    torch.testing.assert_close(out, out_hf, **F32)
    torch.testing.assert_close(g["gate.weight"], g_hf["gate.weight"], **F32)
    torch.testing.assert_close(gx, gx_hf, **F32)
    logits = (x.reshape(-1, 32) @ hf.gate.weight.t()).detach().double().numpy()
    m = logits.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
    lb = float(load_balancing_loss_func((torch.from_numpy(logits),), 5, 2))
    assert float(ours.aux_loss) == pytest.approx(aux * lb + zc * float((lse ** 2).mean()), rel=1e-5)
    wide = dataclasses.replace(ours.moe, router_fp32=False)  # float64 logits, routed in float64
    assert float(z_loss(route(torch.from_numpy(logits), wide))) == pytest.approx(float((lse ** 2).mean()), rel=1e-12)


def loop_reference(x, gate, gate_up, down, moe: MoE):
    """Per token and per expert in Python: the top-k, renormalised, each expert keeping its
    `capacity` most probable slots (ties: the earlier token)."""
    t = x.shape[0]
    probs = torch.softmax(x @ gate.t(), dim=-1)
    top, idx = torch.topk(probs, moe.top_k, dim=-1)
    if moe.normalize:
        top = top / top.sum(-1, keepdim=True)
    cap = t * moe.top_k if moe.capacity_factor is None else math.ceil(moe.capacity_factor * t * moe.top_k / moe.experts)
    kept = set()
    for e in range(moe.experts):
        slots = [(-float(probs[i, e].detach()), i, j) for i in range(t) for j in range(moe.top_k) if int(idx[i, j]) == e]
        kept |= {(i, j) for _, i, j in sorted(slots)[:cap]}
    rows = []
    for i in range(t):
        acc = torch.zeros_like(x[i])
        for j in range(moe.top_k):
            if (i, j) in kept:
                e = int(idx[i, j])
                g, u = (gate_up[e] @ x[i]).chunk(2)
                acc = acc + top[i, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
        rows.append(acc)
    return torch.stack(rows), kept


@pytest.mark.parametrize("cf,normalize", [(None, True), (None, False), (0.5, True), (1.0, False), (1.25, True)])
def test_block_equals_a_per_token_loop_dropless_and_with_a_capacity(cf, normalize):
    """float64 within 1e-10, forward and backward; with a capacity each expert keeps its most
    probable slots (Megatron's drop policy) and a token whose slots all drop gets nothing."""
    moe = MoE(experts=4, top_k=2, ffn=8, capacity_factor=cf, normalize=normalize, router_fp32=False)
    torch.manual_seed(2)
    ours = DenseMoE(16, moe, dtype=torch.float64, device=DEV)
    with torch.no_grad():
        ours.gate.weight.normal_(0, 1.0)  # uneven routing: some experts over capacity
    x = torch.randn(24, 16, dtype=torch.float64, device=DEV)
    xr = x.clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in (ours.gate.weight, ours.gate_up, ours.down)]
    ref, kept = loop_reference(xr, *params, moe)
    out, gx, g = grads(ours, x)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-10)
    w = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype, device=DEV).reshape(ref.shape)
    (ref * w).sum().backward()
    torch.testing.assert_close(gx, xr.grad, rtol=0, atol=1e-10)
    for name, p in zip(("gate.weight", "gate_up", "down"), params):
        torch.testing.assert_close(g[name], p.grad, rtol=0, atol=1e-10)
    cap = moe.capacity(24) or 48
    assert ours.tokens_per_expert.max() <= cap and int(ours.tokens_per_expert.sum()) == len(kept)
    if cf is not None and cf < 1:
        assert len(kept) < 24 * 2  # something was dropped
    dropped = [i for i in range(24) if not any((i, j) in kept for j in range(2))]
    for i in dropped:  # a token with every slot dropped passes through: the block adds nothing
        assert torch.count_nonzero(out[i]) == 0


def test_dropless_equals_a_capacity_nobody_reaches():
    moe = MoE(experts=4, top_k=2, ffn=8, router_fp32=False)
    torch.manual_seed(3)
    a = DenseMoE(16, moe, dtype=torch.float64, device=DEV)
    b = DenseMoE(16, MoE(experts=4, top_k=2, ffn=8, capacity_factor=2.0, router_fp32=False), dtype=torch.float64, device=DEV)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64, device=DEV)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw,match", [
    (dict(experts=4, top_k=5), "top_k 5 is above the expert count 4"),
    (dict(experts=0), "experts must be a positive integer"),
    (dict(capacity_factor=0.0), "capacity_factor must be positive"),
    (dict(aux_coef=-1.0), "loss coefficients"),
    (dict(shared_gate=True), "shared_gate needs a shared expert"),
])
def test_bad_moe_configs_are_one_clear_error(kw, match):
    with pytest.raises(GridError, match=match):
        MoE(**kw)


# ---- on a grid: the variable all-to-all and expert parallelism ---------------------------------


def _all_to_all_v(ctx):
    """Member r sends (r + k) % 3 rows to member k (none to some), each row naming its
    sender, receiver and position; every member checks what arrived against that rule."""
    grid = ctx.init(dp=ctx.world_size)
    n, r = ctx.world_size, ctx.rank
    send = [(r + k) % 3 for k in range(n)]
    recv = [(j + r) % 3 for j in range(n)]
    rows = torch.tensor([[r, k, i] for k in range(n) for i in range(send[k])], dtype=torch.float64,
                        device="cpu").reshape(-1, 3)
    grid.reset_stats()
    got = grid.all_to_all_v(rows, send, recv, "dp")
    want = torch.tensor([[j, r, i] for j in range(n) for i in range(recv[j])], dtype=torch.float64,
                        device="cpu").reshape(-1, 3)
    sent = grid.stats()["dp"]
    errors = []
    try:
        grid.all_to_all_v(rows, send[:-1] + [send[-1] + 1], recv, "dp")  # before anything moves
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    return torch.equal(got, want), sent, sum(send) - send[r], errors


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_v_delivers_every_row_and_counts_its_bytes(pool, n):
    for ok, sent, rows_out, errors in pool.run(_all_to_all_v, n):
        assert ok
        # 3 float64 per row to every other member, one message per non-empty pair
        assert sent["sent_intra"]["bytes"] + sent["sent_inter"]["bytes"] == rows_out * 3 * 8
        assert errors and "send counts add up to" in errors[0]


# DeepSeek-V3's router (sigmoid scores, the balancing bias in the choice, 4 groups of which a
# token's experts come from 2, the routed scale) with its sequence-wise balance loss
DEEPSEEK = dict(scoring="sigmoid", expert_bias=True, groups=4, topk_groups=2, scale=2.5, seq_aux_coef=0.03,
                aux_coef=0.0)


def _expert_parallel(ctx, shape, ep_spec, token_axes, capacity, tp=None, sequence=False, routing=None,
                     overlap=False):
    """The expert-parallel block on this grid against DenseMoE on the whole batch (float64):
    every rank's output rows, its input gradient, the router's and its experts' gradients
    (summed over the ranks that hold them), the auxiliary loss and the tokens per expert.
    tp: a row:N spec, each expert's width split over its ranks (with sequence: the tokens
    arrive as sequence shards over them). overlap: the shared expert computed during the
    dispatch (set_moe_overlap); the exchanges' starts and waits and the shared expert's forward
    and backward are logged, in order, as the fifth result."""
    import gridweave as gw
    from gridweave.grid import LinePart, Span
    from gridweave.nn.moe import DenseMoE, ExpertParallelMoE
    from gridweave.sharding import grad_norm

    if tp is not None:
        shape = dict(shape, tp=dataclasses.replace(gw.modes.parse(tp), sequence=sequence))
    grid = ctx.init(**shape)
    ep = LinePart(tuple(ep_spec[0]), Span.WITHIN, ep_spec[1]) if isinstance(ep_spec, list) else ep_spec
    moe = MoE(**{**dict(experts=8, top_k=2, ffn=8, aux_coef=0.05, z_coef=0.01, router_fp32=False, shared_ffn=5,
                        capacity_factor=capacity), **(routing or {})})
    torch.manual_seed(0)
    dense = DenseMoE(12, moe, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        dense.gate.weight.normal_(0, 1.0)
        if dense.expert_bias is not None:
            dense.expert_bias.normal_(0, 0.3)
    shards = grid.size(token_axes)
    x = torch.randn(shards, 2, 6, 12, dtype=torch.float64, device="cpu")  # (shard, batch, seq, hidden)
    w = torch.randn(x.shape, dtype=torch.float64, device="cpu")
    me = grid.index(token_axes)
    block = ExpertParallelMoE.from_dense(dense, grid, ep, token_axes, "tp" if tp else None, sequence)
    events = []
    if overlap:
        from gridweave.nn.moe import set_moe_overlap

        set_moe_overlap(block, True)
        real = grid.all_to_all_v

        class Logged:
            def __init__(self, work):
                self.work = work

            def wait(self, timeout=None):
                events.append("wait")
                return self.work.wait(timeout)

        def logged(t, send, recv, axis, tag=0, async_op=False):
            events.append("start" if async_op else "exchange")
            h = real(t, send, recv, axis, tag, async_op)
            return Logged(h) if async_op else h

        grid.all_to_all_v = logged
        se = block.shared_expert  # its first half begins with gate_proj, its second is down_proj
        se.gate_proj.register_forward_hook(lambda *a: events.append("shared inner"))
        se.down_proj.register_forward_hook(lambda *a: events.append("shared out"))
        se.gate_proj.register_full_backward_hook(lambda *a: events.append("inner backward"))
        se.down_proj.register_full_backward_hook(lambda *a: events.append("out backward"))
    xr = x.clone().requires_grad_(True)
    if "sp" in token_axes and grid.size("sp") > 1:  # rank (d, s) holds piece s of data shard d's sequences
        d, n = grid.size("dp"), grid.size("sp")
        ref = dense(xr.reshape(d, n, 2, 6, 12).transpose(1, 2).reshape(2 * d, 6 * n, 12))
        ref = ref.reshape(d, 2, n, 6, 12).transpose(1, 2).reshape(x.shape)
    else:
        ref = dense(xr.reshape(-1, 6, 12))  # one process, the whole micro-batch (a capacity ranks over it all)
    (ref * w.reshape(ref.shape)).sum().backward()
    # this rank's tokens: its data shard, and with sequence parallelism its piece of each sequence
    cut = slice(None) if not sequence else slice(3 * grid.index("tp"), 3 * grid.index("tp") + 3)
    ref_out, ref_gx = ref.reshape(x.shape)[me][:, cut], xr.grad[me][:, cut]
    mine = x[me][:, cut].clone().requires_grad_(True)
    out = block(mine)
    (out * w[me][:, cut]).sum().backward()
    first = grid.index(ep) * block.local_experts
    across = LinePart(ep.axes, Span.ACROSS, ep.block) if isinstance(ep, LinePart) else \
        tuple(a for a in token_axes if a not in ((ep,) if isinstance(ep, str) else ep))
    gw.reduce_gradients(block, grid)  # the placements' partial axes: nothing else is summed
    g = {k: p.grad.clone() for k, p in block.named_parameters()}
    norm = float(grad_norm(list(block.parameters()), grid))  # every element once
    counts = block.tokens_per_expert.clone()
    if across and grid.size(across) > 1:
        grid.all_reduce(counts, across)
    ref_g = dict(dense.named_parameters())
    errs = {"out": (out - ref_out).abs().max().item(), "x.grad": (mine.grad - ref_gx).abs().max().item()}
    for k in ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.down_proj.weight"):
        errs[k] = (g[k] - ref_g[k].grad).abs().max().item()
    for k in ("gate_up", "down"):
        want = ref_g[k].grad[first:first + block.local_experts]
        if tp is not None:  # this rank's rows of gate_up (its gate rows, then its up rows), columns of down
            f, i = moe.ffn // grid.size("tp"), grid.index("tp")
            want = torch.cat([want[:, f * i:f * (i + 1)], want[:, moe.ffn + f * i:moe.ffn + f * (i + 1)]], 1) \
                if k == "gate_up" else want[:, :, f * i:f * (i + 1)]
        errs[k] = (g[k] - want).abs().max().item()
    errs["norm"] = abs(norm - float(torch.cat([p.grad.reshape(-1) for p in dense.parameters()]).norm()))
    same_aux = abs(float(block.aux_loss) - float(dense.aux_loss))
    dense_counts = dense.tokens_per_expert[first:first + block.local_experts]
    state = block.dense_state()
    whole = torch.equal(state["gate_up"], dense.gate_up.detach()) and torch.equal(state["down"], dense.down.detach())
    return (errs, same_aux, counts.tolist() == dense_counts.tolist(), whole) + ((events,) if overlap else ())


@pytest.mark.parametrize("shape,ep,token_axes,capacity", [
    (dict(dp=4), "dp", ("dp",), None),  # every expert-parallel member a data-parallel one
    (dict(dp=4), [("dp",), 2], ("dp",), None),  # ep 2 carved out of dp 4: two copies of each expert
    (dict(dp=2, sp=2), "sp", ("dp", "sp"), None),  # ep over the sequence ranks
    (dict(dp=2, sp=2), ("dp", "sp"), ("dp", "sp"), None),  # ep 4 over dp x sp
    (dict(dp=4), [("dp",), 2], ("dp",), 0.75),  # a capacity limit: ranked over the whole micro-batch
    (dict(dp=2, sp=2), ("dp", "sp"), ("dp", "sp"), 0.5),
])
def test_expert_parallel_block_equals_one_process(pool, shape, ep, token_axes, capacity):
    for errs, aux, counts, whole in pool.run(_expert_parallel, 4, shape, ep, token_axes, capacity):
        assert max(errs.values()) < 1e-10, errs
        assert aux < 1e-12 and counts and whole


@pytest.mark.parametrize("shape,ep,token_axes,tp", [
    (dict(dp=2, sp=2), ("dp", "sp"), ("dp", "sp"), None),  # a sequence's tokens over sp: its loss summed there
    (dict(dp=4), [("dp",), 2], ("dp",), None),
    (dict(dp=2), "dp", ("dp",), "row:2"),
])
def test_deepseek_routing_on_expert_grids_equals_one_process(pool, shape, ep, token_axes, tp):
    """DeepSeek-V3's router and sequence-wise loss on expert-parallel grids (float64): the same
    outputs, gradients (the router's through the loss too), loss and loads as DenseMoE."""
    for errs, aux, counts, whole in pool.run(_expert_parallel, 4, shape, ep, token_axes, None, tp, False, DEEPSEEK):
        assert max(errs.values()) < 1e-10, errs
        assert aux < 1e-12 and counts and whole


@pytest.mark.parametrize("shape,ep,token_axes,tp", [
    (dict(dp=4), "dp", ("dp",), None), (dict(dp=2, sp=2), ("dp", "sp"), ("dp", "sp"), None),
    (dict(dp=2), "dp", ("dp",), "row:2"),  # the shared expert's tensor-parallel all-reduces beside the exchange
])
def test_the_shared_expert_overlapped_with_the_dispatch_equals_one_process(pool, shape, ep, token_axes, tp):
    """Megatron-Core's shared-expert overlap (moe_overlap): the shared expert's first half runs
    after the dispatch's exchange starts and before it is waited on, its second half inside the
    combine's; backward, each half's backward between the start and the wait of its exchange's
    reverse (autograd runs the nodes made between an exchange's two halves there); the outputs
    and every gradient are DenseMoE's (float64)."""
    for errs, aux, counts, whole, events in pool.run(_expert_parallel, 4, shape, ep, token_axes, None, tp, False,
                                                     None, True):
        assert max(errs.values()) < 1e-10, errs
        assert aux < 1e-12 and counts and whole
        # forward: the dispatch around the first half, the combine around the second; backward:
        # the combine's reverse around the second half's backward, the dispatch's around the first's
        assert events == ["start", "shared inner", "wait", "start", "shared out", "wait",
                          "start", "out backward", "wait", "start", "inner backward", "wait"], events


def test_the_sequence_wise_balance_loss_is_deepseek_v3s_formula():
    """DeepSeek-V3 eq. 17-20, written out per sequence: f_i = E / (k T) x the tokens choosing i,
    P_i = the mean over the sequence of the scores normalised over the experts; averaged over the
    sequences; its gradient reaches the router through the block's output."""
    from gridweave.nn.moe import DenseMoE

    moe = MoE(experts=6, top_k=2, ffn=4, router_fp32=False, **{**DEEPSEEK, "groups": 3, "topk_groups": 2})
    torch.manual_seed(1)
    block = DenseMoE(8, moe, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        block.gate.weight.normal_(0, 1.0)
        block.expert_bias.normal_(0, 0.3)
    x = torch.randn(3, 5, 8, dtype=torch.float64, device="cpu")
    block(x)
    want = 0.0
    for seq in x:  # one sequence at a time, as the paper writes it
        s = torch.sigmoid(seq @ block.gate.weight.T)
        choice = (s + block.expert_bias).reshape(5, 3, 2)
        groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
        masked = torch.full_like(choice, -torch.inf)
        for t in range(5):
            masked[t, groups[t]] = choice[t, groups[t]]
        top = masked.reshape(5, 6).topk(2, dim=-1).indices
        f = torch.zeros(6, dtype=torch.float64, device="cpu").index_add_(
            0, top.reshape(-1), torch.ones(10, dtype=torch.float64, device="cpu"))
        f = f * 6 / (2 * 5)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        want += float((f * p).sum()) / 3
    assert abs(float(block.aux_loss) - 0.03 * want) < 1e-12, (float(block.aux_loss), 0.03 * want)
    out = block(x.requires_grad_(True))
    out.sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shape,ep,token_axes,capacity,tp,sequence", [
    (dict(dp=2), "dp", ("dp",), None, "row:2", False),  # each expert's width split over tp, ep over dp
    (dict(dp=1), [("dp",), 1], ("dp",), None, "row:4", False),  # tensor parallelism alone inside the experts
    (dict(dp=2), "dp", ("dp",), 0.75, "row:2", True),  # tp_sp: sequence shards gathered, with a capacity
    (dict(dp=2), [("dp",), 1], ("dp",), None, "row:2", True),
])
def test_tensor_parallelism_inside_the_experts_equals_one_process(pool, shape, ep, token_axes, capacity, tp,
                                                                  sequence):
    """Deliverable 2: Megatron's expert tensor parallelism (gate and up by columns, down by rows,
    each expert's rows summed over tp), with and without sequence parallelism, composed with ep."""
    for errs, aux, counts, whole in pool.run(_expert_parallel, 4, shape, ep, token_axes, capacity, tp, sequence):
        assert max(errs.values()) < 1e-10, errs
        assert aux < 1e-12 and counts and whole


def _dispatch_bytes(ctx, ep_spec):
    """The bytes one forward sends over ep: its rows to the other members' experts and the
    rows it ran for them back (hidden float64 values each), and the counts exchanged first."""
    from gridweave.grid import LinePart, Span
    from gridweave.nn.moe import DenseMoE, ExpertParallelMoE

    grid = ctx.init(dp=ctx.world_size)
    ep = LinePart(("dp",), Span.WITHIN, ep_spec) if ep_spec else "dp"
    moe = MoE(experts=8, top_k=2, ffn=6, router_fp32=False)
    torch.manual_seed(0)
    dense = DenseMoE(12, moe, dtype=torch.float64, device="cpu")
    block = ExpertParallelMoE.from_dense(dense, grid, ep, ("dp",))
    x = torch.randn(ctx.world_size, 3, 4, 12, dtype=torch.float64, device="cpu")[grid.index("dp")]
    n, e, me = grid.size(ep), block.local_experts, grid.index(ep)
    # the measured token counts: this rank's slots per member (the dense router's choice), and
    # every member's, gathered
    chosen = torch.topk(torch.softmax(x.reshape(-1, 12) @ dense.gate.weight.t(), -1), 2, -1).indices
    send = torch.bincount(chosen.reshape(-1) // e, minlength=n)
    every = grid.all_gather(send.unsqueeze(0), ep, dim=0)  # every[j, k]: member j's slots for member k
    grid.reset_stats()
    block(x)
    stats = grid.stats()
    label = next(k for k in stats if k != "dp" or not ep_spec)
    s = stats[label]
    rows = int(send.sum() - send[me]) + int(every[:, me].sum() - every[me, me])
    return s["sent_intra"]["bytes"] + s["sent_inter"]["bytes"], rows * 12 * 8 + (n - 1) * e * 8, label


@pytest.mark.parametrize("ep", [0, 2])
def test_dispatch_bytes_equal_the_formula_for_the_token_counts(pool, ep):
    for sent, formula, label in pool.run(_dispatch_bytes, 4, ep):
        assert sent == formula, (label, sent, formula)


def test_equal_slots_across_a_capacity_boundary_are_all_dropped():
    """Identical tokens tie exactly: the ones an expert cannot all keep are all dropped, so what
    drops does not depend on the tokens' order (on the grid)."""
    moe = MoE(experts=2, top_k=1, ffn=4, capacity_factor=1.0, router_fp32=False)  # capacity: T / 2
    torch.manual_seed(5)
    block = DenseMoE(8, moe, dtype=torch.float64, device=DEV)
    a = torch.randn(8, dtype=torch.float64, device=DEV)
    expert = int(torch.argmax(block.gate.weight @ a))
    others = torch.randn(40, 8, dtype=torch.float64, device=DEV)
    others = others[(others @ block.gate.weight.t()).argmax(-1) != expert][:2]  # routed to the other expert
    x = torch.cat([a.expand(4, 8), others])  # 6 tokens, capacity 3: four equal slots for 3 places
    out = block(x.unsqueeze(0))[0]
    assert torch.count_nonzero(out[:4]) == 0 and torch.count_nonzero(out[4:], dim=-1).min() > 0
    assert block.tokens_per_expert.tolist()[expert] == 0
    perm = torch.tensor([4, 0, 1, 5, 2, 3], device=DEV)
    shuffled = block(x[perm].unsqueeze(0))[0]
    torch.testing.assert_close(shuffled, out[perm], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kw,world,match", [
    (dict(experts=6, ep=4, dp=4), 4, "6 experts do not split over ep=4"),
    (dict(experts=4, top_k=5), 1, "top_k 5 is above the expert count 4"),
    (dict(ep=3, dp=4), 4, "ep=3 does not divide dp x sp = 4 x 1"),
    (dict(tp="square:2"), 4, "splits each token's hidden vector"),
    (dict(tp="row:2", moe_ffn=15), 2, "experts of width 15 do not split over tp 2"),
    # DeepSeek-V3's: group-limited routing beyond its groups, latent attention where its sequence or
    # hidden vector is split, a key/value head count, a dense first layer for every layer
    (dict(model="deepseek-v3", experts=4, expert_groups=2, topk_groups=3), 1, "topk_groups 3 is above the group count"),
    (dict(model="deepseek-v3", experts=6, expert_groups=4), 1, "6 experts do not split into 4 groups"),
    (dict(model="deepseek-v3", sp=2, attention="rsa"), 2, "latent attention over sp runs with attention ring, "),
    (dict(model="deepseek-v3", sp=2, v_dim=20), 2, "pads the values to the queries' width: v_dim 20 is wider"),
    (dict(model="deepseek-v3", tp="cube:2"), 8, "latent attention runs with the sequence split over sp"),
    (dict(model="deepseek-v3", kv_heads=2), 1, "no key/value head count"),
    (dict(model="deepseek-v3", dense_first=2), 1, "keeps at least one sparse layer"),
    (dict(moe_overlap=True, ep=2, dp=2), 2, "moe_overlap computes the shared expert during the experts' dispatch"),
    (dict(moe_overlap=True, shared_ffn=8), 1, "it needs ep > 1 and a shared expert"),
])
def test_bad_expert_parallel_jobs_are_one_clear_error_before_any_rank_starts(kw, world, match):
    """What `gridweave train` checks on the launcher's side (TrainConfig and its grid_shape)."""
    import gridweave as gw

    with pytest.raises(GridError, match=match):
        cfg = gw.train.TrainConfig(**{"model": "mixtral", "hidden": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8,
                                      "tokenizer": "bytes", "pp": 1, **kw})
        cfg.grid_shape(world)


def test_ep_needs_a_mixture_of_experts():
    import gridweave as gw

    with pytest.raises(GridError, match="ep=2 splits a mixture of experts: it needs model mixtral"):
        gw.train.TrainConfig(model="llama", ep=2)


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 16, 0, 0], [4, 4, 4, 4]])
def test_torchs_grouped_gemm_equals_the_loop_over_experts(counts):
    """The two ways of running the experts (torch's grouped_mm where it runs: float32 here; the
    loop of products), forward and backward, empty experts included."""
    from gridweave.nn.moe import can_group, swiglu_experts

    torch.manual_seed(6)
    x = torch.randn(sum(counts), 16, dtype=torch.float32, device=DEV)
    gate_up = torch.randn(4, 16, 16, dtype=torch.float32, device=DEV)
    down = torch.randn(4, 16, 8, dtype=torch.float32, device=DEV)
    assert can_group(x, gate_up, down) and not can_group(x.double(), gate_up.double(), down.double())
    w = torch.randn(sum(counts), 16, dtype=torch.float32, device=DEV)
    results = []
    for grouped in (True, False):
        ins = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
        out = swiglu_experts(ins[0], counts, ins[1], ins[2], grouped=grouped)
        (out * w).sum().backward()
        results.append([out.detach()] + [t.grad for t in ins])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("imbalance,cf", [(1.0, None), (2.5, None), (2.0, 0.75)])
def test_a_planned_routing_runs_exactly_its_counts(imbalance, cf):
    """The planner's routing (nn.moe.planned_route, what its meta-device recording runs, where the
    router's choices cannot be read): expert 0 takes `imbalance` times the mean, the others the
    rest evenly, each capped at the capacity; the block run with it (plan_routing) equals a
    per-slot loop over that routing's experts and weights (float64)."""
    from gridweave.nn.moe import plan_routing, planned_counts, planned_route

    moe = MoE(experts=4, top_k=2, ffn=8, capacity_factor=cf, router_fp32=False)
    torch.manual_seed(3)
    block = DenseMoE(16, moe, dtype=torch.float64, device=DEV)
    x = torch.randn(24, 16, dtype=torch.float64, device=DEV)
    counts = planned_counts(48, 4, imbalance)
    assert sum(counts) == 48 and counts[0] == round(imbalance * 12) and max(counts[1:]) - min(counts[1:]) <= 1
    r = planned_route(block.gate(x), moe, imbalance)
    kept = counts if cf is None else [min(c, moe.capacity(24)) for c in counts]
    assert r.known == kept == r.counts.tolist() and torch.bincount(r.experts.reshape(-1), minlength=4).tolist() == counts
    slots = r.experts.reshape(-1)[r.order]
    assert torch.equal(slots, slots.sort().values) and slots.numel() == sum(kept)
    plan_routing(block, imbalance)
    out = block(x)
    ref = torch.zeros_like(x)
    for s in r.order.tolist():
        t, j = divmod(s, moe.top_k)
        e = int(r.experts.reshape(-1)[s])
        g, u = (block.gate_up[e] @ x[t]).chunk(2)
        ref[t] += r.weights[t, j] * (block.down[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    with pytest.raises(GridError, match="expert imbalance must be between 1"):
        planned_counts(48, 4, 0.5)


def _planned(cfg, grid, imbalance=1.0):
    import gridweave as gw

    model = gw.plan.Model(cfg, batch=8, bytes_per_value=4, expert_imbalance=imbalance)
    return model, gw.plan.schedule_of(model, grid, 1)


def test_the_planner_records_active_flops_dispatch_bytes_and_expert_shares_by_formula():
    """Deliverable 5: a mixture of experts' recorded step (the planner's) against the formulas:
    FLOPs are the active parameters' (the dense model whose MLP is top_k experts wide, plus the
    router's 6 T H E a layer); with ep 2 and imbalance 2 the recorded rank (it holds the most
    loaded expert) runs 18 H F FLOPs for each row it receives, and sends each dispatch and
    combine, forward and backward, the rows of the formula; its parameters are the others plus
    E/ep of the experts."""
    import gridweave as gw
    from gridweave.nn.moe import planned_counts

    h, f, e, k, layers, seq = 32, 48, 8, 2, 2, 16
    cfg = gw.models.ModelConfig("llama", 256, h, 4, layers, seq, kv_heads=2, moe=MoE(experts=e, top_k=k, ffn=f))
    dense = dataclasses.replace(cfg, moe=None, ffn_hidden=k * f)
    tokens = 8 // 4 * seq  # dp 4: two sequences a rank
    _, moe1 = _planned(cfg, gw.plan.GridShape(dp=4))
    _, ref = _planned(dense, gw.plan.GridShape(dp=4))
    assert moe1.microbatch.flops - ref.microbatch.flops == layers * 6 * tokens * h * e
    _, moe2 = _planned(cfg, gw.plan.GridShape(dp=4, ep=2), imbalance=2.0)
    c = planned_counts(tokens * k, e, 2.0)
    received = 2 * sum(c[:e // 2])  # both members send the rank holding experts 0-3 what it sends itself
    assert moe2.microbatch.flops - moe1.microbatch.flops == layers * 18 * h * f * (received - tokens * k)
    # a send, or one issued in the same group (recorder.GROUPED_SEND)
    sent = [x.nbytes for x in moe2.microbatch.collectives if x.op.startswith("send") and x.axis == "dp:within2"]
    rows = [sum(c[e // 2:]), sum(c[:e // 2])]  # dispatch to member 1, combine back what it sent
    assert sorted(sent) == sorted(layers * 2 * [r * h * 4 for r in rows])
    whole = sum(p.numel() for p in gw.models.build(cfg, device="meta").parameters())
    experts = layers * e * 3 * h * f
    assert moe2.parameters == whole - experts + experts // 2 and moe1.parameters == whole


def test_the_planner_ranks_ep_with_the_other_axes_and_checks_it_as_train_does():
    """Every expert-parallel degree that divides dp x sp and the experts is enumerated (and trains:
    GridShape.check is gridweave train's rule); a given grid's ep round-trips through --grid;
    a more imbalanced routing is predicted slower; a bad ep is one clear error."""
    import gridweave as gw

    cfg = gw.train.TrainConfig(model="mixtral", hidden=32, heads=4, layers=2, seq=16, batch=8, tokenizer="bytes",
                               experts=4)
    model = gw.plan.model_of(cfg)
    grids = gw.plan.enumerate_grids(8, model, placements=("topology",), zeros=(0,))
    assert {g.ep for g in grids if g.dp * g.sp == 8} == {1, 2, 4}
    assert all((g.dp * g.sp) % g.ep == 0 for g in grids)
    g = gw.plan.GridShape(dp=4, pp=2, ep=4)
    assert gw.plan.GridShape.parse(g.spec()) == g
    cluster = gw.plan.load_cluster("a100-ib")
    times = [gw.plan.predict(dataclasses.replace(model, expert_imbalance=f), g, cluster)["step_time_s"]
             for f in (1.0, 3.0)]
    assert times[1] > times[0]
    rows = gw.plan.plan(8, model, cluster, top=3)
    assert rows and all("ep" in r for r in rows)
    for bad, match in ((dict(dp=4, ep=3), "ep=3 does not divide dp x sp"), (dict(dp=8, ep=8), "4 experts do not")):
        with pytest.raises(GridError, match=match):
            gw.plan.predict(model, gw.plan.GridShape(**bad), cluster)


def test_plan_from_run_plans_the_imbalance_the_run_measured(tmp_path, capsys):
    """gridweave plan --from-run OUT: the run's model and its measured loads (the busiest expert
    over an even share, averaged over layers and steps, written out here) predict the step as
    --expert-imbalance of that value does; a run without expert loads is one clear error."""
    import json

    import gridweave as gw
    from gridweave import cli

    cfg = gw.models.ModelConfig("llama", 256, 32, 4, 2, 16, kv_heads=2, moe=MoE(experts=4, top_k=2, ffn=16))
    (tmp_path / "model_config.json").write_text(json.dumps(cfg.to_dict()))
    steps = [[[10, 2, 2, 2], [4, 4, 4, 4]], [[6, 6, 2, 2], [0, 0, 0, 0]]]  # [step][layer][expert]
    (tmp_path / "metrics.json").write_text(json.dumps({"tokens_per_expert": steps}))
    measured = (10 * 4 / 16 + 1.0 + 6 * 4 / 16) / 3  # the silent layer left out
    grid = ["--grid", "dp=4,ep=2", "--batch", "8", "--cluster", "a100-ib", "--json"]
    assert cli.main(["plan", "--from-run", str(tmp_path), *grid]) == 0
    out = capsys.readouterr()
    assert f"expert imbalance {measured:.3f}" in out.err
    assert cli.main(["plan", "--model", str(tmp_path), "--expert-imbalance", repr(measured), *grid]) == 0
    assert capsys.readouterr().out == out.out
    assert cli.main(["plan", "--model", str(tmp_path), *grid]) == 0  # balanced: faster
    assert json.loads(capsys.readouterr().out)["step_time_s"] < json.loads(out.out)["step_time_s"]
    (tmp_path / "metrics.json").write_text(json.dumps({"loss": [1.0]}))
    assert cli.main(["plan", "--from-run", str(tmp_path), *grid]) == 2
    assert "holds no tokens per expert" in capsys.readouterr().err
    assert cli.main(["plan", "--from-run", str(tmp_path), "--model", "mixtral", *grid]) == 2
    assert "leave out --model" in capsys.readouterr().err


def test_init_from_a_mixtral_folder_sets_its_experts(tmp_path):
    """--init-from a transformers Mixtral folder: the run is model mixtral with that folder's
    experts (a field given as well must agree), and its expert-parallel checks read them."""
    import gridweave as gw

    cfg = gw.models.ModelConfig("llama", 256, 32, 4, 2, 16, kv_heads=2,
                                moe=gw.nn.MoE(experts=4, top_k=2, ffn=16, aux_coef=0.02))
    gw.models.build(cfg, device="cpu").save_hf(tmp_path)
    run = gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, pp=1)
    assert run.model == "mixtral" and (run.experts, run.top_k, run.moe_ffn) == (4, 2, 16)
    assert run.model_config(256).moe == cfg.moe
    with pytest.raises(GridError, match="4 experts do not split over ep=8"):
        gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=16, pp=1, dp=8,
                             ep=8).grid_shape(8)
    with pytest.raises(GridError, match="its experts is 4, this run asks 6"):
        gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, experts=6)


def test_an_exchanges_sends_are_charged_one_fixed_cost():
    """The expert exchange's sends to the other ep members travel as one group
    (Grid.all_to_all_v's batch): the engine counts each as a send, the planner charges the
    group's fixed cost (launch and per-collective) once and each send its latency and bytes."""
    import gridweave as gw
    from gridweave.recorder import GROUPED_SEND

    cfg = gw.models.ModelConfig("llama", 256, 32, 4, 1, 16, kv_heads=2, moe=MoE(experts=4, top_k=2, ffn=16))
    model = gw.plan.Model(cfg, batch=8, bytes_per_value=4, embedding=False)
    grid = gw.plan.GridShape(dp=4, ep=4)
    on_line = [c for c in gw.plan.schedule_of(model, grid, 1).microbatch.collectives if c.axis == "dp:within4"]
    # the counts' all-to-all, then dispatch and combine forward, combine's and dispatch's gradients backward
    assert [c.op for c in on_line if c.op != "recv"] == ["all_to_all"] + ["send", GROUPED_SEND, GROUPED_SEND] * 4
    cluster = dataclasses.replace(gw.plan.load_cluster("a100-ib"), collective_s=1.0)  # a second per group
    costly = gw.plan.predict(model, grid, cluster)["seconds_per_axis"]["dp:within4"]
    cheap = gw.plan.predict(model, grid, dataclasses.replace(cluster, collective_s=0.0))["seconds_per_axis"]
    # one all-to-all and four groups of sends: five fixed costs, not thirteen
    assert costly - cheap["dp:within4"] == pytest.approx(5.0)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_init_from_a_qwen_moe_folder_sets_its_model(tmp_path, kind):
    """--init-from a Qwen2-MoE or Qwen3-MoE folder: the run is that model (its q/k/v biases or
    per-head norms, its shared expert), read back as it was written."""
    import gridweave as gw

    extra = dict(moe=MoE(experts=4, top_k=2, ffn=16, normalize=False, shared_ffn=12, shared_gate=True),
                 qkv_bias=True) if kind == "qwen2_moe" else dict(moe=MoE(experts=4, top_k=2, ffn=16), qk_norm=True)
    cfg = gw.models.ModelConfig("llama", 256, 32, 4, 2, 16, kv_heads=2, **extra)
    gw.models.build(cfg, device="cpu").save_hf(tmp_path)
    run = gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, pp=1)
    assert run.model == kind.replace("_", "-") and run.shared_ffn == (12 if kind == "qwen2_moe" else 0)
    got = run.model_config(256)
    assert (got.moe, got.qkv_bias, got.qk_norm) == (cfg.moe, cfg.qkv_bias, cfg.qk_norm)


def test_init_from_a_deepseek_folder_sets_its_model(tmp_path):
    """--init-from a DeepSeek-V3 folder: the run is model deepseek-v3 with that folder's latent
    attention, routing and dense first layer, read back as written; on a grid that splits each
    token's hidden vector (2-D), one error before any rank starts; Megatron's sequence parallelism
    takes it."""
    import gridweave as gw

    moe = MoE(experts=4, top_k=2, ffn=16, shared_ffn=16, scoring="sigmoid", scale=2.0, groups=2, topk_groups=1,
              expert_bias=True)
    cfg = gw.models.ModelConfig("llama", 256, 32, 4, 2, 16, 24, moe=moe, dense_layers=(0,),
                                mla=gw.nn.MLA(kv_rank=8, q_rank=12, nope=6, rope=4, v=8))
    gw.models.build(cfg, device="cpu").save_hf(tmp_path)
    run = gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, pp=1)
    assert run.model == "deepseek-v3" and (run.experts, run.top_k, run.moe_ffn) == (4, 2, 16)
    assert run.model_config(256) == dataclasses.replace(cfg, eps=1e-6)  # the export writes Llama's default
    with pytest.raises(GridError, match="latent attention runs with the sequence"):
        gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, pp=1,
                             tp="square:2").grid_shape(4)
    assert gw.train.TrainConfig(init_from=str(tmp_path), tokenizer="bytes", seq=16, batch=8, pp=1, tp="row:2",
                                tp_sp=True).grid_shape(2) == {"dp": 1, "pp": 1, "sp": 1}
