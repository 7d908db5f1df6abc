"""Sharded checkpoints (gw.checkpoint): every rank writes only its shards; any grid loads
them back by reading the slices it needs; a round trip through three grids is bit-identical;
a damaged or incomplete checkpoint is one clear error naming the file, and an interrupted save
leaves the previous step loadable."""
import pytest
import torch

import gridweave as gw

CPU = torch.device("cpu")


def _dense():
    torch.manual_seed(0)
    m = gw.models.Llama(64, 32, 4, 2, 16, kv_heads=2, ffn_hidden=40, dtype=torch.float64, device=CPU)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype, device=CPU))
    return m


GRIDS = {"row:2 x pp2": dict(tp="row:2", pp=2), "cube:2": dict(tp="cube:2"), "square:2 x dp2": dict(tp="square:2", dp=2),
         "subgraph:2 x sp2": dict(tp="subgraph:2", sp=2), "csub:2 x pp2": dict(tp="csub:2", pp=2),
         "dp4 x pp2": dict(dp=4, pp=2), "one": dict()}
SIZES = {"row:2 x pp2": 4, "cube:2": 8, "square:2 x dp2": 8, "subgraph:2 x sp2": 4, "csub:2 x pp2": 4, "dp4 x pp2": 8,
         "one": 1}


def _stage(ctx, spec):
    kw = dict(GRIDS[spec])
    tp = gw.modes.parse(kw.pop("tp", "none"))
    grid = ctx.init(tp=tp, **kw)
    model = gw.models.build(_dense().config, dtype=torch.float64, device=grid.device)
    pp = grid.axes["pp"]
    return grid, gw.models.GPTStage(model, grid, tp, grid.coords["pp"], pp)


def _save(ctx, spec, folder, step, from_folder=None):
    grid, stage = _stage(ctx, spec)
    if from_folder is None:
        stage.load_dense_state(_dense().state_dict())
    else:
        _, local = gw.checkpoint.load(from_folder, stage.sharded_items(), grid, ("param",))
        with torch.no_grad():
            for p in stage.parameters():
                p.copy_(local["param"][id(p)])
    gw.checkpoint.save(folder, step, stage.sharded_items(), grid, lambda p: {"param": p}, {"config": spec})
    dense = _dense().state_dict()  # compared here: tensors do not travel back from an MPI pool's ranks
    return {k: bool(torch.equal(v, dense[k])) for k, v in stage.dense_state(False).items()}


@pytest.mark.parametrize("a,b,c", [("row:2 x pp2", "cube:2", "one"), ("square:2 x dp2", "subgraph:2 x sp2", "dp4 x pp2"),
                                   ("csub:2 x pp2", "row:2 x pp2", "square:2 x dp2")])
def test_a_round_trip_through_three_grids_is_bit_identical(pool, tmp_path, a, b, c):
    dense = {k: v for k, v in _dense().state_dict().items()}
    grids = [a, b, c]
    sizes = [SIZES[g] for g in grids]
    prev = None
    for i, (g, size) in enumerate(zip(grids, sizes)):
        folder = tmp_path / f"ck{i}"
        for same in pool.run(_save, size, g, folder, i + 1, prev):
            assert all(same.values()), (g, [k for k, v in same.items() if not v])  # every rank's stage
        back = gw.checkpoint.export_dense(folder)
        assert back.keys() == dense.keys()
        assert all(torch.equal(back[k], dense[k]) for k in dense), g
        prev = folder


def _bytes_written(folder):
    step = gw.checkpoint.open_index(folder)[0]
    return sum(f.stat().st_size for f in step.glob("rank-*.safetensors"))


def test_each_rank_writes_only_its_shards(pool, tmp_path):
    """8 ranks of a cube: the shards add up to the model once (no rank writes a copy of another's)."""
    dense = _dense()
    total = sum(v.numel() * v.element_size() for v in dense.state_dict().values())
    pool.run(_save, 8, "cube:2", tmp_path / "cube", 1)
    pool.run(_save, 1, "one", tmp_path / "one", 1)
    cube, one = _bytes_written(tmp_path / "cube"), _bytes_written(tmp_path / "one")
    assert one < total * 1.05 and cube < total * 1.05 + 8 * 4096, (cube, one, total)  # headers only on top
    index = gw.checkpoint.open_index(tmp_path / "cube")[1]
    assert len(index["files"]) == 8
    assert len(index["tensors"]["param/layers.0.qkv.weight"]["chunks"]) == 8  # a block per cube rank


def test_damage_is_one_clear_error_naming_the_file(pool, tmp_path):
    pool.run(_save, 4, "row:2 x pp2", tmp_path / "ck", 1)
    step = tmp_path / "ck" / "step-00000001"
    shard = step / "rank-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(gw.GridError, match="rank-2.safetensors does not match its checksum"):
        gw.checkpoint.export_dense(tmp_path / "ck")
    shard.unlink()
    with pytest.raises(gw.GridError, match="rank-2.safetensors named by .* is missing"):
        gw.checkpoint.open_index(tmp_path / "ck")
    (step / "index.json").write_text("{ truncated")
    with pytest.raises(gw.GridError, match="index.json is not valid JSON"):
        gw.checkpoint.open_index(tmp_path / "ck")


def test_an_interrupted_save_leaves_the_previous_step(pool, tmp_path):
    pool.run(_save, 4, "row:2 x pp2", tmp_path / "ck", 1)
    pool.run(_save, 4, "row:2 x pp2", tmp_path / "ck", 2)
    # a third save killed after its shards, before its index and the pointer
    (tmp_path / "ck" / "step-00000003").mkdir()
    (tmp_path / "ck" / "step-00000003" / "rank-0.safetensors").write_bytes(b"partial")
    step, index = gw.checkpoint.open_index(tmp_path / "ck")
    assert step.name == "step-00000002" and index["step"] == 2
    assert (tmp_path / "ck" / "step-00000001").exists()  # the newest two complete steps are kept
    assert gw.checkpoint.export_dense(tmp_path / "ck").keys() == _dense().state_dict().keys()


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (3, 2, 2, 3)])
def test_a_flat_slice_of_a_block_is_its_rectangular_pieces(shape):
    """ZeRO cuts the flattened parameters anywhere: every flat range of a 1- to 4-D block (an
    expert stack is 3-D) is the row-major concatenation of the pieces flat_blocks names (numpy)."""
    import itertools

    import numpy as np

    from gridweave.checkpoint import flat_blocks

    block = [[2, 2 + n] for n in shape]
    full = np.arange(int(np.prod([n + 4 for n in shape]))).reshape([n + 4 for n in shape])
    local = full[tuple(slice(s, e) for s, e in block)].reshape(-1)
    for lo, hi in itertools.combinations(range(local.size + 1), 2):
        pieces = flat_blocks(block, lo, hi)
        assert len(pieces) <= 2 * len(shape) - 1
        got = np.concatenate([full[tuple(slice(s, e) for s, e in b)].reshape(-1) for b, _, _ in pieces])
        assert [(x, y) for _, x, y in pieces] == list(zip([0] + [y for _, _, y in pieces][:-1],
                                                           [y for _, _, y in pieces]))
        np.testing.assert_array_equal(got, local[lo:hi])
