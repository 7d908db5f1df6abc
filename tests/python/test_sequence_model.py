"""The whole model on sequence shards (Li et al. §3: no rank holds the whole sequence): with sp
each rank embeds its own L/N tokens at their global positions, runs the head on them and scores
them; the loss is the sum over the sequence ranks of each shard's part. Checked against the
dense single-process model (float64: logits, the loss and every gradient) for every attention
over sp, every family, tensor modes composed with sp, packed documents and experts, and the
shapes the ends hold."""
import pytest
import torch

from tp_refs import DEVICE, full, packed_documents, rel

V, H, HEADS, L, B = 64, 32, 4, 32, 4


def _perturbed(model):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.05 * full(p.shape, 200 + i, p.dtype, p.device))
    return model


def _config(family, moe, tie=False):
    import gridweave as gw

    if tie:
        return gw.models.ModelConfig(family, V, H, HEADS, 2, L, tie=True)
    if family == "llama":  # grouped-query attention: 2 key/value heads for 4 query heads
        return gw.models.ModelConfig("llama", V, H, HEADS, 2, L, kv_heads=2,
                                     moe=gw.nn.MoE(experts=4, top_k=2, ffn=24) if moe else None)
    return gw.models.ModelConfig(family, V, H, HEADS, 2, L)


def _mode(tp):
    import gridweave as gw

    return gw.Row(2, sequence=True) if tp == "row:2+sp" else gw.modes.parse(tp)


def _model(ctx, family, tp, sp, dp, attention, u, packed, moe, fused=False, tie=False):
    import gridweave as gw

    grid = ctx.init(tp=_mode(tp), sp=sp, dp=dp)
    torch.manual_seed(0)
    dense = _perturbed(gw.models.build(_config(family, moe, tie), dtype=torch.float64, device=DEVICE))
    stage = gw.models.GPTStage(dense, grid, _mode(tp), 0, 1, attention=attention, ulysses_degree=u, fused_loss=fused)
    seen = {}
    for name, mod in (("embed", stage.embed), ("head", stage.head.ln)):  # the head's tokens: its features'
        mod.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, tuple(o.shape)))
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, V, (B * dp, L), generator=g, device="cpu").to(DEVICE)
    y = torch.randint(0, V, (B * dp, L), generator=g, device="cpu").to(DEVICE)
    y[:, ::5] = gw.models.IGNORE  # some tokens not predicted: the count is the whole sequence's
    docs = packed_documents(B * dp, L, 3) if packed else None
    logits = dense(x, docs)
    count = float((y != gw.models.IGNORE).sum())
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=gw.models.IGNORE,
                                             reduction="sum") / count
    loss.backward()
    rows = slice(grid.coords["dp"] * B, (grid.coords["dp"] + 1) * B)
    mine_docs = None if docs is None else docs[rows]
    if packed == "balanced":  # the trainer's path: the chunks each ring member holds dealt by work
        mine_docs = stage.pack(mine_docs.cpu())
        assert isinstance(mine_docs, gw.documents.Packed) == (sp > 1 and attention in ("ring", "usp"))
    mine = stage(x[rows], mine_docs)
    share = stage.loss(mine, y[rows], normalizer=count)
    share.backward()
    gw.reduce_gradients(stage, grid)
    total = share.detach().reshape(1).clone()
    grid.all_reduce(total, axis=("dp", "sp"))  # every rank's share: its replica's shard, over the global count
    errs = {"logits": rel(stage.full_logits(mine), logits[rows]), "loss": rel(total, loss.detach().reshape(1))}
    grads = stage.dense_state(pick=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    vocab = V // grid.axes.get("tp", 1) if stage.vocab_axis is not None else V
    return errs, seen, tuple(mine.shape), H if fused else vocab


@pytest.mark.parametrize("family,tp,sp,dp,attention,u,packed,moe", [
    ("gpt", "none", 4, 1, "ring", 1, False, False), ("gpt", "none", 2, 2, "rsa", 1, False, False),
    ("gpt", "row:2", 2, 1, "ulysses", 1, False, False), ("gpt", "none", 4, 2, "usp", 2, False, False),
    ("gpt", "none", 4, 1, "ring", 1, True, False), ("llama", "none", 4, 1, "ring", 1, False, False),
    ("llama", "row:2+sp", 2, 2, "ring", 1, False, False), ("llama", "none", 2, 1, "ulysses", 1, True, False),
    ("llama", "none", 4, 1, "usp", 2, True, False), ("llama", "square:2", 2, 1, "ring", 1, False, False),
    ("llama", "none", 2, 2, "ring", 1, False, True), ("llama", "row:2", 2, 1, "ring", 1, True, True),
    ("gpt", "subgraph:2", 2, 1, "ring", 1, False, False), ("llama", "cube:2", 1, 1, "ring", 1, False, False),
    ("llama", "none", 1, 2, "ring", 1, False, True), ("llama", "row:2", 1, 1, "ring", 1, False, True),
    ("llama", "none", 4, 1, "ring", 1, "balanced", False), ("gpt", "none", 4, 2, "usp", 2, "balanced", False),
    ("llama", "row:2+sp", 2, 2, "ring", 1, "balanced", False), ("llama", "row:2", 2, 1, "ring", 1, "balanced", True),
    ("gpt", "none", 2, 1, "ulysses", 1, "balanced", False)])
def test_the_ends_run_on_sequence_shards_and_equal_the_dense_model(pool, family, tp, sp, dp, attention, u, packed,
                                                                     moe):
    """Each rank's embedding output and logits hold L/sp positions (and the vocabulary over tp
    where the head splits it); gathered, the logits equal the dense model's; the shares of the loss
    summed over sp and dp equal its loss; every gradient equals its gradient (float64 1e-10).
    "balanced": packed documents as the trainer gives them (stage.pack: the ring's chunks dealt
    by attention work; Ulysses keeps its contiguous shards)."""
    n = sp * dp * _mode(tp).ranks()
    for errs, seen, logits, vocab in pool.run(_model, n, family, tp, sp, dp, attention, u, packed, moe):
        assert max(errs.values()) < 1e-10, {name: e for name, e in errs.items() if e >= 1e-10}
        assert seen["embed"][1] == L // sp and seen["head"][1] == L // sp, seen
        assert logits == (B, L // sp, vocab), logits


def _sharded_ends(ctx, sp):
    """The largest activation the ends hold on a rank: the embedding output and the logits."""
    import gridweave as gw

    grid = ctx.init(sp=sp)
    stage = gw.models.GPTStage(gw.models.build(_config("gpt", False), dtype=torch.float64, device=DEVICE), grid,
                               None, 0, 1)
    x = torch.zeros((B, L), dtype=torch.int64, device=DEVICE)
    return stage.embed(stage.shard_tokens(x)).numel(), stage(x).numel()


def test_the_ends_hold_one_over_sp_of_the_whole_sequence(pool):
    """The embedding's output and the logits on each of N sequence ranks are 1/N of one process's."""
    one = pool.run(_sharded_ends, 1, 1)[0]
    for sp in (2, 4):
        for got in pool.run(_sharded_ends, sp, sp):
            assert got == (one[0] // sp, one[1] // sp)


@pytest.mark.parametrize("family,tp,sp,dp,attention,tie", [
    ("gpt", "none", 4, 1, "ring", False), ("bert", "row:2", 2, 1, "ring", False),
    ("llama", "row:2+sp", 2, 2, "ring", False), ("gpt", "row:2", 1, 2, "ring", False),
    ("gpt", "none", 2, 1, "ulysses", True), ("bert", "none", 1, 1, "ring", False)])
def test_the_fused_head_and_loss_equal_the_dense_model(pool, family, tp, sp, dp, attention, tie):
    """fused_loss (Liger-Kernel's fused linear cross-entropy): the last stage returns the head's
    features and the loss projects and scores them chunk by chunk, the gradients made in the
    forward; the loss, the logits projected from the features and every gradient equal the dense
    model's (float64 1e-10), on sequence shards, over a vocabulary split by tensor parallelism
    (Megatron's: its sums all-reduced there), with a masked LM's projection bias and with the
    projection tied to the embedding."""
    n = sp * dp * _mode(tp).ranks()
    for errs, seen, out, width in pool.run(_model, n, family, tp, sp, dp, attention, 1, False, False, True, tie):
        assert max(errs.values()) < 1e-10, {name: e for name, e in errs.items() if e >= 1e-10}
        assert out == (B, L // sp, H) and seen["head"] == out, (out, seen)


def test_linear_cross_entropy_is_torch_s_and_makes_no_gradient_without_grad_mode():
    """gw.autograd.vocab.linear_cross_entropy against F.cross_entropy(F.linear(...), reduction="sum")
    (float64 1e-12; in float32 within 1e-5), chunks of one token, of several and of all of them,
    ignored targets; under no_grad the sum alone; features that take no gradient."""
    from gridweave.autograd.vocab import linear_cross_entropy

    g = torch.Generator().manual_seed(3)
    for dtype, tol, (rows, hidden, vocab) in ((torch.float64, 1e-12, (37, 16, 96)), (torch.float64, 1e-12, (5, 64, 8)),
                                              (torch.float64, 1e-12, (4, 2, 16)), (torch.float32, 1e-5, (64, 32, 50))):
        h, w, b = (torch.randn(shape, generator=g, dtype=dtype, device="cpu").to(DEVICE).requires_grad_()
                   for shape in ((rows, hidden), (vocab, hidden), (vocab,)))
        t = torch.randint(0, vocab, (rows,), generator=g, device="cpu").to(DEVICE)
        t[::3] = -100
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), t, reduction="sum")
        grads = torch.autograd.grad(want * 0.7, (h, w, b))
        got = linear_cross_entropy(h, w, b, t)
        assert rel(got, want) < tol
        for a, e in zip(torch.autograd.grad(got * 0.7, (h, w, b)), grads):
            assert rel(a, e) < tol
        with torch.no_grad():
            quiet = linear_cross_entropy(h, w, b, t)
        assert rel(quiet, want) < tol and not quiet.requires_grad
        frozen = h.detach()  # the features' gradient is not made where they take none
        got = torch.autograd.grad(linear_cross_entropy(frozen, w, b, t) * 0.7, (w, b))
        assert all(rel(a, e) < tol for a, e in zip(got, grads[1:]))
