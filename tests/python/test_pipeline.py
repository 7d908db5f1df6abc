"""AxoNN (AxoNN): message-driven and 1F1B pipelines x data parallelism train a GPT with
one process's losses; OffloadAdam equals AdamW; faults give clear errors."""
import math
import os
import time

import pytest
import torch

from tp_refs import DEVICE, rel

CPU = torch.device("cpu")

V, H, HEADS, LAYERS, SEQ, BATCH, STEPS = 32, 16, 2, 4, 8, 8, 20


def _data():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (BATCH, SEQ + 1), generator=g, device="cpu").to(DEVICE)
    return ids[:, :-1], ids[:, 1:]


def _reference():
    import gridweave as gw

    torch.manual_seed(0)
    model = gw.models.GPT(V, H, HEADS, LAYERS, SEQ, device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _pipeline(ctx, stages, schedule, slow_stage=-1, ac=1, die_stage=-1, receive="auto", overlap=False):
    import gridweave as gw

    dp = ctx.world_size // stages
    grid = ctx.init(dp=dp, pp=stages, timeout=20.0)
    torch.manual_seed(0)
    model = gw.models.GPT(V, H, HEADS, LAYERS, SEQ, device=DEVICE)
    s = grid.coords["pp"]
    layers = model.stage_layers(s, stages)

    class Slow(torch.nn.Module):
        def forward(self, x):
            time.sleep(0.02)
            return x

    if s == slow_stage:
        layers = layers[:1] + [Slow()] + layers[1:]
    n_transformer = LAYERS // stages
    # Transformer layers go through PipelineStage (checkpointed in groups of ac); the
    # embedding (first stage) and the head (last stage) wrap around them.
    blocks = [m for m in layers if isinstance(m, gw.nn.DenseTransformerLayer)]
    first = [m for m in layers[:1] if not isinstance(m, gw.nn.DenseTransformerLayer)]
    tail = [m for m in layers[1:] if not isinstance(m, gw.nn.DenseTransformerLayer)]
    stage = torch.nn.Sequential(*first, gw.pipeline.PipelineStage(blocks, total_layers=LAYERS, ac=ac), *tail)
    params = [p for m in layers for p in m.parameters()]
    opt = gw.optim.OffloadAdam(params, lr=1e-2, bsize=97, coarsening=2, grid=grid, overlap=overlap)
    x, y = _data()
    shard = BATCH // dp
    opt.backwards_per_step = shard  # one backward per micro-batch
    lo = grid.coords["dp"] * shard
    micro_x = [x[lo + i:lo + i + 1] for i in range(shard)]
    micro_y = [y[lo + i:lo + i + 1] for i in range(shard)]
    losses = []
    for step in range(STEPS):
        if step == 2 and s == die_stage:
            os._exit(3)
        opt.zero_grad()
        loss, stats = gw.pipeline.pipeline_step(stage, grid, micro_x, micro_y, model.loss, (1, SEQ, H),
                                                schedule=schedule, pipeline_limit=2, receive=receive)
        if overlap:  # the last backward started every chunk's all-reduce: none is left to the step
            assert opt._next == len(opt._chunks) > 1, (opt._next, len(opt._chunks))
        opt.step()
        if loss is not None:
            t = loss.reshape(1).clone()
            grid.all_reduce(t, axis="dp")
            losses.append(t.item() / dp)
    return losses, s == stages - 1, _copies_and_ahead(stats, s)


def _copies_and_ahead(stats, stage):
    """What a stage's PipelineStats say about its messages: (messages received, payload copies,
    bytes copied, receives posted ahead, stage)."""
    return stats.messages, stats.copies, stats.copied_bytes, stats.posted_ahead, stage


def _check_copies_and_ahead(res, payload, schedule, receive):
    """One copy per message (into the tensor the stage computes on; every send goes out of the
    stage's own tensor, or its host copy for a host transport), and the receives posted ahead: 1F1B and interleaved know what comes next
    on each link and post it before the compute of the message before it, so only a stage's first
    activation, needed before any compute, is not; receive-from-any and per-peer re-post before
    the compute of the message they delivered (all but a stage's first); the announced strategy
    posts a data receive only for an announced message."""
    # the rank pool shares one GPU through Gloo, whose messages are host memory: each send is also
    # copied to the host first, and every stage sends as many messages as it receives
    per_message = 1 if DEVICE.type == "cpu" else 2
    for messages, copies, copied, ahead, stage in res:
        assert messages > 0
        assert copies == per_message * messages and copied == per_message * messages * payload, \
            (stage, messages, copies, copied)
        if schedule in ("1f1b", "interleaved"):
            assert ahead == messages - (stage > 0), (stage, messages, ahead)
        elif receive == "announced":
            assert ahead == 0, (stage, messages, ahead)
        else:
            assert ahead == messages - 1, (stage, messages, ahead)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _check(res, reference, stages, n):
    """Exactly the last stage's ranks (one per data-parallel row) report losses, and theirs
    are the one-process losses."""
    last = [losses for losses, is_last, _ in res if is_last]
    assert len(last) == n // stages
    assert all(not losses for losses, is_last, _ in res if not is_last)
    for losses in last:
        assert len(losses) == len(reference)
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < 1e-5, (losses, reference)


# receive: "any" (receive-from-any, Gloo's), "per_peer" (one receive per neighbour) and
# "announced" (a host control channel says which neighbour sends next: what NCCL uses) all
# run here on Gloo, through the same engine code.
@pytest.mark.parametrize("stages,n", [(2, 4), (4, 8)])
@pytest.mark.parametrize("schedule,receive", [("message_driven", "any"), ("message_driven", "per_peer"),
                                              ("message_driven", "announced"), ("1f1b", "auto")])
def test_gpt_trains_with_one_process_losses(pool, reference, stages, n, schedule, receive):
    if receive == "any" and not pool.capabilities()["recv_any"]:
        return _refused_without_receive_from_any(pool, n, stages, schedule)
    res = pool.run(_pipeline, n, stages, schedule, receive=receive)
    _check(res, reference, stages, n)
    assert reference[-1] < reference[0]
    _check_copies_and_ahead([r[2] for r in res], SEQ * H * 4, schedule, receive)


@pytest.mark.parametrize("schedule", ["message_driven", "1f1b"])
def test_offload_adam_overlapping_the_backward_trains_with_one_process_losses(pool, reference, schedule):
    """OffloadAdam(overlap=True): each chunk's all-reduce starts in the backward that completes it
    (the last micro-batch's), in one order on every rank; the losses are still one process's."""
    _check(pool.run(_pipeline, 4, 2, schedule, receive="per_peer" if schedule == "message_driven" else "auto",
                    overlap=True), reference, 2, 4)


def test_offload_adam_unstaged_equals_staged():
    """On a device whose memory is the host's, OffloadAdam updates its flat buffers in place (no
    bucket copies); the arithmetic is the staged path's: torch's fused AdamW kernel on either.
    Its vector and scalar lanes may round an element differently where a bucket starts, so one
    two steps (weight-decay masks, clipping, states no longer zero) agree within float32's
    rounding; more are not compared, as Adam turns an ulp of a parameter whose gradient is zero
    (the key bias) into a whole step."""
    import gridweave as gw

    if DEVICE.type != "cpu":  # on a GPU the automatic choice is staged: both runs would be one path
        torch.manual_seed(0)
        opt = gw.optim.OffloadAdam(gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE).parameters(), bsize=61)
        assert opt.staged and opt._staging is not None
        pytest.skip("the unstaged path is for a device whose memory is the host's (CPU)")
    runs = []
    for staged in (True, None):
        torch.manual_seed(0)
        model = gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE)
        opt = gw.optim.OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.1, bsize=61, coarsening=3,
                                   max_grad_norm=0.5, decay=gw.optim.matrices_only, staged=staged)
        assert opt.staged == (staged is True) and (opt._staging is not None) == opt.staged
        x, y = _data()
        for _ in range(2):  # the second step's states are not zero
            opt.zero_grad()
            model.loss(model(x), y).backward()
            opt.step()
        runs.append((model.state_dict(), opt.state_dict()["state"], opt.last_grad_norm))
    (wa, sa, na), (wb, sb, nb) = runs
    assert na == pytest.approx(nb, rel=1e-6)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7)
    for i in sa:
        for k in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("receive", ["any", "per_peer", "announced"])
def test_a_slow_stage_changes_timing_not_results(pool, reference, receive):
    if receive == "any" and not pool.capabilities()["recv_any"]:
        return _refused_without_receive_from_any(pool, 4, 2, "message_driven")
    _check(pool.run(_pipeline, 4, 2, "message_driven", 0, receive=receive), reference, 2, 4)


def test_activation_checkpointing_keeps_results(pool, reference):
    _check(pool.run(_pipeline, 4, 2, "message_driven", -1, 2), reference, 2, 4)


def _refused_without_receive_from_any(pool, n, stages, schedule):
    """Under NCCL's rules (--emulate=nccl) there is no receive-from-any: asked for, it is one
    clear error on every rank before any message."""
    for status, value in pool.run(_pipeline, n, stages, schedule, receive="any", raw=True):
        assert status == "err" and "cannot receive from any peer" in value, value


def _receive_any_capability(ctx):
    import gridweave as gw

    grid = ctx.init(pp=2)
    caps = grid.capabilities("pp")
    errs = []
    for kw in ({"schedule": "sideways"}, {"receive": "sometimes"}):
        try:
            gw.pipeline.pipeline_step(torch.nn.Identity(), grid, [torch.zeros(1, device=DEVICE)],
                                      [torch.zeros(1, device=DEVICE)], lambda o, t: o.sum(), (1,), **kw)
        except gw.GridError as e:
            errs.append(str(e))
    return caps, errs


def test_transport_capabilities_and_bad_strategies(pool):
    emulated = os.environ.get("GRIDWEAVE_EMULATE") == "nccl"
    for caps, errs in pool.run(_receive_any_capability, 2):
        assert caps["recv_any"] is not emulated  # Gloo and MPI receive from any peer; NCCL does not
        assert "schedule must be one of" in errs[0] and "receive must be one of" in errs[1]


def test_a_pipeline_peer_that_dies_gives_a_clear_error(pool):
    res = pool.run(_pipeline, 4, 2, "message_driven", -1, 1, 1, raw=True, timeout=90)
    died = [r for r in res if r[0] == "died"]
    errors = [r[1] for r in res if r[0] == "err"]
    if not pool.capabilities()["survives_peer_failure"]:  # MPI: mpirun ends the whole job
        assert len(died) == len(res), res
        return
    assert died and errors
    for e in errors:
        assert "CommError" in e or "CommTimeout" in e, e


def test_offload_adam_equals_adamw_step_by_step():
    import gridweave as gw

    torch.manual_seed(1)
    a = gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE)
    b = gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE)
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(a.parameters(), lr=3e-3, weight_decay=0.1)
    mine = gw.optim.OffloadAdam(b.parameters(), lr=3e-3, weight_decay=0.1, bsize=101, coarsening=3)
    x, y = _data()
    for _ in range(5):
        ref.zero_grad()
        a.loss(a(x), y).backward()
        # the same gradients for both: CUDA's embedding backward adds with atomics, so two
        # backward passes differ in the last bit, which Adam's g / sqrt(v) magnifies
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = p.grad.clone()
        ref.step()
        mine.step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def _storages(obj, seen=None):
    """Every tensor storage reachable from `obj`'s attributes: (data_ptr, bytes, device)."""
    out = {} if seen is None else seen
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor) else [obj]
    for v in items:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            out[st.data_ptr()] = (st.nbytes(), v.device.type, v.dtype)
        elif isinstance(v, (dict, list, tuple)):
            _storages(v, out)
    return out


def test_offload_memory_accounting():
    """AxoNN §V: with a half-precision model, the device holds 4 phi (weights and gradients)
    plus 16 bsize (the bucket buffers), the host 12 phi (fp32 master and two states); the
    optimizer's own accounting agrees with what its tensors really take."""
    import gridweave as gw

    model = gw.models.GPT(V, H, HEADS, 2, SEQ, dtype=torch.float16, device=DEVICE)
    phi = sum(p.numel() for p in model.parameters())
    opt = gw.optim.OffloadAdam(model.parameters(), bsize=128, staged=True)  # AxoNN's device buckets
    x, y = _data()
    model.loss(model(x).float(), y).backward()
    held = _storages(opt)  # everything the optimizer keeps (it holds the parameters too)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    grads = _storages([p.grad for p in model.parameters()])
    held.update(_storages([slot for slot in opt._staging.slots]))  # the device buckets' two slots
    fp32 = sum(b for ptr, (b, _, dt) in held.items() if ptr not in params and dt == torch.float32)
    model_bytes = sum(held[ptr][0] for ptr in params) + sum(b for b, _, _ in grads.values())
    assert model_bytes == 4 * phi                        # fp16 weights + fp16 gradients
    # host master + 2 states, device buckets, and the steps taken (one float32 on the device: the
    # fused update's bias correction reads it there, so a skipped step needs no host read)
    assert fp32 == 12 * phi + 16 * 128 + 4
    buckets = opt._staging.nbytes()
    assert buckets == 16 * 128
    acc = opt.device_bytes()
    assert acc["total"] == model_bytes + buckets
    assert acc["without_offload"] == 20 * phi


def test_optimal_ac():
    import gridweave as gw

    assert gw.pipeline.optimal_ac(8, 64) == 8   # sqrt(64) = 8 is a factor
    assert gw.pipeline.optimal_ac(12, 48) == 6  # sqrt(48) ~ 6.9: closest factor of 12
    assert gw.pipeline.optimal_ac(6, 4) == 2
    with pytest.raises(gw.GridError):
        gw.pipeline.PipelineStage([torch.nn.Identity()] * 3, ac=2)


def test_offload_adam_state_dict_round_trip():
    """torch's optimizer protocol: a fresh OffloadAdam loaded from another's state_dict takes
    the same next steps; a state of the wrong shape is refused before anything is written."""
    import gridweave as gw

    torch.manual_seed(2)
    a = gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE)
    b = gw.models.GPT(V, H, HEADS, 2, SEQ, device=DEVICE)
    opt_a = gw.optim.OffloadAdam(a.parameters(), lr=3e-3, bsize=61)
    x, y = _data()
    for _ in range(3):
        opt_a.zero_grad()
        a.loss(a(x), y).backward()
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = gw.optim.OffloadAdam(b.parameters(), lr=1.0, bsize=61)
    sd = opt_a.state_dict()
    assert sd["param_groups"][0]["params"] == list(range(len(list(a.parameters()))))
    opt_b.load_state_dict(sd)
    assert opt_b.step_count == 3 and opt_b.lr == 3e-3
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    bad = opt_a.state_dict()
    bad["state"][0] = {**bad["state"][0], "exp_avg": torch.zeros(3, device=DEVICE)}
    before = opt_b.exp_avg.clone()
    with pytest.raises(gw.GridError, match="exp_avg of parameter 0"):
        opt_b.load_state_dict(bad)
    assert torch.equal(opt_b.exp_avg, before)


def _interleaved(ctx, tp, chunks, m):
    import gridweave as gw

    mode = gw.modes.parse(tp)
    grid = ctx.init(tp=mode, pp=2)
    torch.manual_seed(0)
    dense = gw.models.Llama(64, 32, 4, 2 * chunks, 16, kv_heads=2, ffn_hidden=40, dtype=torch.float64,
                            device=grid.device)
    s, p = grid.coords["pp"], 2
    stages = [gw.models.GPTStage(dense, grid, mode, c * p + s, chunks * p) for c in range(chunks)]
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1), device=CPU).to(grid.device)
    tgt = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2), device=CPU).to(grid.device)
    dense.loss(dense(ids), tgt).backward()
    mb = 4 // m
    xs, ys = [ids[i * mb:(i + 1) * mb] for i in range(m)], [tgt[i * mb:(i + 1) * mb] for i in range(m)]
    loss, st = gw.pipeline.pipeline_step(stages, grid, xs, ys, stages[-1].loss, stages[0].activation_shape(mb, 16),
                                         dtype=torch.float64, schedule="interleaved")
    ref = dict(dense.named_parameters())
    errs = {}
    for stage in stages:
        gw.reduce_gradients(stage, grid)
        errs.update({k: rel(g, ref[k].grad) for k, g in stage.dense_state(True).items()})
    full = dense.loss(dense(ids), tgt).item()
    payload = math.prod(stages[0].activation_shape(mb, 16)) * 8
    return (errs, (None if loss is None else abs(loss.item() - full) / full), st.forwards, st.backwards,
            _copies_and_ahead(st, s), payload)


@pytest.mark.parametrize("tp,chunks,m", [("none", 2, 2), ("none", 2, 4), ("row:2", 2, 2), ("none", 4, 2)])
def test_interleaved_schedule_equals_the_dense_model(pool, tp, chunks, m):
    """Megatron's interleaved 1F1B (Megatron-LM Fig. 4): v model chunks per stage, the last stage
    feeding the first one's next chunk; every gradient and the loss equal the dense model."""
    n = 2 if tp == "none" else 4
    res = pool.run(_interleaved, n, tp, chunks, m)
    for errs, loss_err, fw, bw, _, _ in res:
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert loss_err is None or loss_err < 1e-10
        assert fw == bw == chunks * m
    _check_copies_and_ahead([r[4] for r in res], res[0][5], "interleaved", "auto")


def _stage_members_agree(ctx, tp, sp, receive):
    import gridweave as gw

    mode = gw.modes.parse(tp)
    pp, m, mb = 3, 4, 2
    grid = ctx.init(tp=mode, pp=pp, sp=sp, timeout=30.0)
    torch.manual_seed(0)
    dense = gw.models.Llama(64, 32, 4, pp, 16, kv_heads=2, ffn_hidden=40, dtype=torch.float64, device=grid.device)
    s = grid.coords["pp"]
    stage = gw.models.GPTStage(dense, grid, mode, s, pp)
    first_line = all(grid.coords[a] == 0 for a in grid.axes if a not in ("pp", "dp"))

    class Late(torch.nn.Module):
        """Stage 0's first line sends its activations late: the middle stage's members then see
        a gradient and an activation arrive in opposite orders."""

        def __init__(self):
            super().__init__()
            self.stage = stage

        def forward(self, x):
            y = self.stage(x)
            if s == 0 and first_line:
                time.sleep(0.2)
            return y

    ids = torch.randint(0, 64, (m * mb, 16), generator=torch.Generator().manual_seed(1), device=CPU).to(grid.device)
    tgt = torch.randint(0, 64, (m * mb, 16), generator=torch.Generator().manual_seed(2), device=CPU).to(grid.device)
    dense.loss(dense(ids), tgt).backward()
    xs, ys = [ids[i * mb:(i + 1) * mb] for i in range(m)], [tgt[i * mb:(i + 1) * mb] for i in range(m)]
    loss, st = gw.pipeline.pipeline_step(Late(), grid, xs, ys, stage.loss, stage.activation_shape(mb, 16),
                                         dtype=torch.float64, schedule="message_driven", pipeline_limit=2,
                                         receive=receive)
    gw.reduce_gradients(stage, grid)
    if loss is not None and stage.loss_partial:  # each sequence rank's share: their sum is the loss
        loss = loss.detach().reshape(1).clone()
        grid.all_reduce(loss, axis=stage.loss_partial)
    ref = dict(dense.named_parameters())
    errs = {k: rel(g, ref[k].grad) for k, g in stage.dense_state(True).items()}
    full = dense.loss(dense(ids), tgt).item()
    return errs, (None if loss is None else abs(loss.item() - full) / full), st.forwards, st.backwards


@pytest.mark.parametrize("tp,sp", [("row:2", 1), ("none", 2)])
@pytest.mark.parametrize("receive", ["auto", "announced"])  # auto: receive-from-any where the transport has it
def test_the_ranks_of_a_stage_take_their_messages_in_one_order(pool, tp, sp, receive):
    """Message-driven with tensor- or sequence-parallel stages: the ranks of a stage between two
    others run collectives together inside each forward and backward, so they must handle their
    neighbours' messages in one order even when the messages reach them in different orders (here
    one line's activations are late); the first member decides, the others follow. Every gradient
    and the loss equal the dense model's (without the agreement the stage's collectives pair a
    forward with a backward and the ranks hang)."""
    for errs, loss_err, fw, bw in pool.run(_stage_members_agree, 6, tp, sp, receive):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}
        assert loss_err is None or loss_err < 1e-10
        assert fw == bw == 4


def test_a_stage_holds_an_outgoing_tensor_until_its_send_is_done():
    """The engine sends what a callback returns in place (cpp/pipeline.cpp), so the callbacks hold
    each outgoing tensor until the engine says its send is done (sent), then let it go: a middle
    stage holds the gradients still on their way, not one per micro-batch. Each received message
    is copied once, into the tensor the stage computes on (the engine's buffer takes another)."""
    import weakref
    from types import SimpleNamespace

    from gridweave import _C
    from gridweave.pipeline import _StageCallbacks

    cpu = torch.device("cpu")  # host messages, whatever the default device
    stage = torch.nn.Linear(4, 4, dtype=torch.float64, device=cpu)
    pp = SimpleNamespace(rank=1, size=3, device=_C.Device.CPU)
    m, shape = 3, (2, 4)
    cb = _StageCallbacks([stage], pp, None, None, None, m, shape, torch.float64, cpu)
    msgs = [torch.randn(shape, dtype=torch.float64, device=cpu) for _ in range(2 * m)]  # activations, then gradients
    for mb in range(m):
        addr = cb.forward(mb, 0, msgs[mb].data_ptr())
        x, y = cb.ctx[(mb, 0)]
        assert addr == y.data_ptr() and x.data_ptr() != msgs[mb].data_ptr()  # y in place; x a copy
        msgs[mb].zero_()  # the engine's buffer takes another message: the stage's input is its own
        assert not torch.equal(x.detach(), torch.zeros_like(x))
        cb.sent(addr)
    del x, y  # the stage's own references only (ctx)
    sent = []
    for mb in range(m):
        addr = cb.backward(mb, 0, msgs[m + mb].data_ptr())
        held = cb.outgoing[addr]
        assert len(held) == 1 and held[0].data_ptr() == addr
        sent.append((addr, weakref.ref(held[0])))
    # the input gradient of the last micro-batch is d(x W^T + b)/dx = g W, as torch computes it
    assert torch.equal(cb.outgoing[sent[-1][0]][0], msgs[2 * m - 1] @ stage.weight.detach())
    assert [r() is None for _, r in sent] == [False] * m  # all on their way
    for addr, _ in sent[:-1]:
        cb.sent(addr)
    assert [r() is None for _, r in sent] == [True] * (m - 1) + [False]
    cb.sent(sent[-1][0])
    assert not cb.outgoing and sent[-1][1]() is None
    assert cb.copies == 2 * m and cb.copied_bytes == 2 * m * 2 * 4 * 8  # one copy per message received
