"""Packed documents (issue 31): several documents in one sequence, attention within each and
positions restarting at each. The independent reference is each document run alone through the
dense model; every mode's layer and the main job are checked against the dense packed one."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rankpool import launcher_args
from tp_refs import DEVICE, full, packed_documents, rel

H, HEADS, B, L = 32, 4, 4, 16


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_packed_sequence_is_its_documents_run_alone(family):
    """The dense model on packed documents (GPT-2's learned and Llama's rotary positions restart)
    gives each document's logits exactly as the document alone would."""
    import gridweave as gw

    cfg = gw.models.ModelConfig(family, 64, H, HEADS, 2, 24)
    torch.manual_seed(0)
    model = gw.models.GPT(config=cfg, dtype=torch.float64, device=DEVICE)
    ids = torch.randint(0, 64, (3, 24), device=DEVICE)
    docs = packed_documents(3, 24, 1)
    out = model(ids, docs)
    for b in range(3):
        for d in docs[b].unique():
            idx = (docs[b] == d).nonzero().flatten()
            sl = slice(int(idx[0]), int(idx[-1]) + 1)
            assert rel(out[b:b + 1, sl], model(ids[b:b + 1, sl])) < 1e-12
    assert rel(out, model(ids)) > 1e-3  # the masks matter


def _layer(ctx, tp, sp, dp, attention, ulysses_degree, family):
    import gridweave as gw

    mode = gw.modes.parse(tp)
    grid = ctx.init(tp=mode, sp=sp, dp=dp)
    torch.manual_seed(0)
    arch = gw.nn.LLAMA if family == "llama" else gw.nn.GPT2
    dense = gw.nn.DenseTransformerLayer(H, HEADS, bias=family == "gpt", dtype=torch.float64, device=DEVICE,
                                        arch=arch)
    layer = gw.nn.TransformerLayer.from_dense(dense, grid, mode=mode.name if mode.name != "sp" else "sp",
                                              attention=attention, ulysses_degree=ulysses_degree)
    x = full((B * dp, L, H), 11).requires_grad_()
    docs = packed_documents(B * dp, L, 2)
    y = dense(x, docs)
    dy = full(y.shape, 12)
    y.backward(dy)
    lay = layer.input_layout
    xl = gw.scatter(x.detach(), lay, grid).requires_grad_()
    rows = slice(grid.coords["dp"] * B, (grid.coords["dp"] + 1) * B)  # this replica's batch
    yl = layer(xl, docs[rows])
    yl.backward(gw.scatter(dy, layer.output_layout, grid))
    gw.reduce_gradients(layer, grid)
    errs = {"y": rel(gw.gather(yl, layer.output_layout, grid), y),
            "dx": rel(gw.gather(xl.grad, lay, grid), x.grad)}
    grads = layer.dense_state(grad=True)
    for name, p in dense.named_parameters():
        errs[name] = rel(grads[name], p.grad)
    return errs


@pytest.mark.parametrize("tp,sp,dp,attention,u,family", [
    ("none", 4, 1, "ring", 1, "llama"), ("none", 2, 2, "rsa", 1, "gpt"), ("none", 4, 2, "ulysses", 1, "llama"),
    ("none", 4, 1, "usp", 2, "llama"), ("row:2", 2, 2, "ring", 1, "llama"), ("row:2", 2, 1, "ulysses", 1, "gpt"),
    ("square:2", 1, 2, "ring", 1, "llama"), ("cube:2", 1, 1, "ring", 1, "gpt")])
def test_every_mode_masks_packed_documents_like_the_dense_layer(pool, tp, sp, dp, attention, u, family):
    """A layer on packed documents (float64, forward and backward) equals the dense one on grids
    of every sp algorithm, 1-D with the ring and Ulysses, with dp, and the batch-splitting 2-D
    and 3-D modes (each rank picks its rows' document ids from the layout its qkv holds)."""
    import gridweave as gw

    n = sp * dp * gw.modes.parse(tp).ranks()
    for errs in pool.run(_layer, n, tp, sp, dp, attention, u, family):
        assert max(errs.values()) < 1e-10, {k: v for k, v in errs.items() if v >= 1e-10}


def test_packed_documents_bad_input_fails_before_anything_runs():
    import gridweave as gw

    with pytest.raises(gw.GridError, match="SUPER's branches"):
        gw.train.TrainConfig(heads=4, hidden=32, tp="subgraph:2", pack_documents=True, dp=1, pp=1).grid_shape(2)
    model = gw.models.GPT(vocab=64, hidden=H, heads=HEADS, layers=1, seq=16, dtype=torch.float64, device=DEVICE)
    ids = torch.zeros(2, 16, dtype=torch.int64, device=DEVICE)
    with pytest.raises(gw.GridError, match=r"documents must be integer ids of shape \(batch, sequence\) = \(2, 16\)"):
        model(ids, torch.zeros(2, 15, dtype=torch.int64, device=DEVICE))
    with pytest.raises(gw.GridError, match="documents must be integer ids"):
        model(ids, torch.zeros(2, 16, device=DEVICE))


def test_the_token_file_knows_its_documents(tmp_path):
    """prepare records where each document (a fortune: the text between "%" lines) starts; the
    reader's packed batches carry those ids, and its tokens are next()'s."""
    import numpy as np

    import gridweave as gw

    corpus = tmp_path / "c.txt"
    texts = ["first fortune\nover two lines\n", "second\n", "a third, longer, one " * 8 + "\n"] * 20
    corpus.write_text("%\n".join(texts))
    gw.data.prepare(tmp_path / "run", str(corpus), "bytes")
    tokens = gw.data.open_tokens(tmp_path / "run")
    starts = np.cumsum([0] + [len(t) + 2 for t in texts[:-1]])  # each text and its "%\n"
    assert tokens.documents.tolist() == starts.tolist()
    a = gw.data.Reader(tokens.train, 32, 4, seed=1)
    b = gw.data.Reader(tokens.train, 32, 4, seed=1)
    x, y = a.next()
    xp, yp, docs = b.next_packed(tokens.documents)
    assert torch.equal(x, xp) and torch.equal(y, yp)
    for row, ids in zip(xp, docs):  # a token after "%\n" opens a new document, and only there
        text = bytes(row.tolist())
        new = [i for i in range(1, 32) if ids[i] != ids[i - 1]]
        assert new == [i for i in range(1, 32) if i >= 2 and text[i - 2:i] == b"%\n"]


def _train(tmp, name, n, extra, pack=True, port=29691, timeout=600):
    out = tmp / name
    cmd = [sys.executable, "-m", "gridweave.cli", "train", *launcher_args(), "--nproc", str(n), "--model", "llama",
           "--hidden", "32", "--heads", "4", "--layers", "4", "--seq", "32", "--batch", "8", "--microbatches", "2",
           "--steps", "3", "--val-every", "0", "--sample-tokens", "0", "--tokenizer", "bytes", "--warmup", "1",
           "--quiet", "--out", str(out), *(["--pack-documents"] if pack else []),
           "--device", DEVICE.type, *extra]  # device auto puts 1 rank on a GPU and 8 sharing one on the host
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", GRIDWEAVE_PORT=str(port)),
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())["loss"]


def test_the_main_job_packs_documents_on_composed_grids(tmp_path):
    """--pack-documents on row:2 + tp-sp x sp2 (ring) x pp2 and on sp4 (USP, U 2) x dp2 gives one
    process's packed losses (float32 1e-5); unpacked ones differ."""
    one = _train(tmp_path, "one", 1, ["--dp", "1", "--pp", "1"])
    ring = _train(tmp_path, "ring", 8, ["--tp", "row:2", "--tp-sp", "--sp", "2", "--pp", "2", "--dp", "1"], port=29687)
    usp = _train(tmp_path, "usp", 8, ["--sp", "4", "--attention", "usp", "--ulysses-degree", "2", "--dp", "2",
                                      "--pp", "1"], port=29689)
    for losses in (ring, usp):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, one)) < 1e-5, (losses, one)
    unpacked = _train(tmp_path, "unpacked", 1, ["--dp", "1", "--pp", "1"], pack=False)
    assert max(abs(a - b) for a, b in zip(unpacked, one)) > 1e-4


# ---- work-balanced shards over the ring ------------------------------------------------------

def _skewed(batch, length, long_share, seed):
    """(batch, length) ids: one long document of long_share of the row at a random place among short
    ones of 4 to 24 tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.int64, device="cpu")
    for b in range(batch):
        long_at = int(torch.randint(0, length - int(long_share * length), (1,), generator=g, device="cpu"))
        i, d = 0, 0
        while i < length:
            n = int(long_share * length) if i <= long_at < i + 24 or i == long_at else \
                int(torch.randint(4, 25, (1,), generator=g, device="cpu"))
            out[b, i:i + n] = d
            i, d = i + n, d + 1
    return out


def _pair_work(documents, order, causal):
    """Each member's attention work counted token by token (numpy-free brute force): the pairs of
    its query tokens and every key token that may attend, and the blocks holding any such pair."""
    from gridweave.documents import document_mask

    L = documents.shape[1]
    pos = torch.arange(L, device="cpu")
    visible = document_mask(documents, pos, pos, causal).any(0)[0]  # (L, L): any row
    c = order.chunk
    blocks = visible.reshape(L // c, c, L // c, c).any(3).any(1)
    return visible, blocks


@pytest.mark.parametrize("members,length,long_share,causal", [(4, 512, 0.5, True), (8, 1024, 0.4, True),
                                                             (4, 512, 0.6, False), (2, 256, 0.5, True)])
def test_balanced_order_evens_the_attention_work_of_skewed_documents(members, length, long_share, causal):
    """One long document among many short: the zigzag (positions dealt evenly) leaves a member with
    well over the mean work once the blocks no document crosses are skipped; the balanced order
    keeps every member within 10% of the mean, each holding the same number of chunks. The chunk
    visibility it skips by equals the token pairs' (brute force over the document mask)."""
    from gridweave.documents import balanced_order, member_work

    docs = _skewed(2, length, long_share, 7)
    zig = balanced_order(docs, members, causal, balance=False)
    even = balanced_order(docs, members, causal)
    for order in (zig, even):
        _, blocks = _pair_work(docs, order, causal)
        assert order.visible == frozenset(map(tuple, blocks.nonzero().tolist()))
        assert sorted(j for m in order.members for j in m) == list(range(blocks.shape[0]))  # a partition
        assert len({len(m) for m in order.members}) == 1  # equal tokens on every member
    mean = sum(member_work(even, causal)) / members
    assert max(abs(w - mean) / mean for w in member_work(even, causal)) < 0.10, member_work(even, causal)
    if causal:  # the skew is real (contiguous shards of a bidirectional model see across the long document)
        zmean = sum(member_work(zig, causal)) / members
        assert max(member_work(zig, causal)) / zmean > 1.10, member_work(zig, causal)


def _ring_order(ctx, causal, n, u, seed):
    """Ring attention (or USP) on shards dealt by a balanced order, packed documents, float64: its
    output and gradients against torch's attention over the whole sequence with the document mask."""
    import gridweave as gw
    from gridweave.autograd.ring import ring_attention
    from gridweave.autograd.ulysses import usp_attention
    from gridweave.documents import balanced_order, document_mask

    grid = ctx.init(sp=n)
    heads, A, Lx = 4, 8, 256
    docs = _skewed(2, Lx, 0.5, seed)
    q, k, v = (full((2, heads, Lx, A), s).requires_grad_() for s in (21, 22, 23))
    pos = torch.arange(Lx, device=DEVICE)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs.to(DEVICE), pos,
                                                                                              pos, causal))
    dout = full(ref.shape, 24)
    ref.backward(dout)
    order = balanced_order(docs, n // u, causal)
    mine = order.permutation("cpu")[grid.index("sp") * (Lx // n):(grid.index("sp") + 1) * (Lx // n)]
    ql, kl, vl = (t.detach()[:, :, mine].contiguous().requires_grad_() for t in (q, k, v))
    d = docs.to(DEVICE)
    if u == 1:
        out = ring_attention(ql, kl, vl, grid, causal=causal, documents=d, order=order)
    else:
        inner, outer = gw.LinePart(("sp",), gw.Span.WITHIN, u), gw.LinePart(("sp",), gw.Span.ACROSS, u)
        out = usp_attention(ql, kl, vl, grid, inner, outer, causal, d, order)
    out.backward(dout[:, :, mine].contiguous())
    errs = {"out": rel(out, ref[:, :, mine])}
    for name, loc, whole in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errs[name] = rel(loc.grad, whole.grad[:, :, mine])
    return errs


@pytest.mark.parametrize("n,u,causal", [(2, 1, True), (4, 1, True), (4, 1, False), (4, 2, True), (8, 2, True)])
def test_ring_attention_on_balanced_shards_equals_one_process(pool, n, u, causal):
    """The ring (and USP's ring across its Ulysses blocks) on shards dealt by work, skipping the
    blocks no document crosses: its output and every gradient equal one process's (float64)."""
    for errs in pool.run(_ring_order, n, causal, n, u, 3):
        assert max(errs.values()) < 1e-10, errs
