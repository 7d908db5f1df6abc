"""The MPI transport through gw.init(backend="mpi") under mpirun: ranks from MPI itself (no
TCP store), segmented collectives on per-line communicators, a 1-D layer against the dense
one, the message-driven pipeline on MPI's receive-from-any, and MPI finalised at exit."""
import json
import os
import textwrap

import pytest

import gridweave as gw
from rankpool import mpirun

pytestmark = pytest.mark.skipif(not gw.launch.mpi_installed(),
                                reason="needs gridweave built with MPI and mpirun (apt-get install libopenmpi-dev)")

SCRIPT = textwrap.dedent('''
    import json, os, torch
    import gridweave as gw
    from tp_refs import full, rel

    grid = gw.init(dp=2, tp=gw.Row(2), timeout=30.0)  # auto: MPI, since mpirun started the ranks
    out = {"rank": grid.rank, "world": grid.world_size, "backend": grid.backend}
    t = torch.full((4,), float(grid.rank), device="cpu")
    out["tp_sum"] = grid.all_reduce(t.clone(), axis="tp")[0].item()
    out["dp_gather"] = grid.all_gather(t[:1], axis="dp").tolist()
    out["tp_ranks"], out["dp_ranks"] = grid.ranks("tp"), grid.ranks("dp")
    torch.manual_seed(0)
    dense = gw.nn.DenseTransformerLayer(16, 4, dtype=torch.float64, device="cpu")
    layer = gw.nn.TransformerLayer.from_dense(dense, grid)
    x = full((4, 6, 16), 1).requires_grad_()
    y = dense(x)
    y.backward(torch.ones_like(y))
    xl = gw.scatter(x.detach(), layer.input_layout, grid).requires_grad_()
    yl = layer(xl)
    yl.backward(torch.ones_like(yl))
    out["err"] = max(rel(gw.gather(yl, layer.output_layout, grid), y),
                     rel(gw.gather(xl.grad, layer.input_layout, grid), x.grad))
    out["recv_any"] = grid.capabilities("tp")["recv_any"]
    gw.shutdown()
    # a grid of the first two ranks of MPI's world; the others are refused, before any message
    try:
        sub = gw.init(dp=2, world_size=2, backend="mpi", timeout=30.0)
        out["sub"] = sub.all_reduce(torch.ones(2, device="cpu"), axis="dp").tolist()
        gw.shutdown()
    except gw.GridError as e:
        out["sub"] = str(e)
    grid = gw.init(pp=4, backend="mpi", timeout=30.0)  # the message-driven pipeline on MPI
    stage = torch.nn.Linear(3, 3, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        stage.weight.copy_(torch.eye(3, dtype=torch.float64, device="cpu") * 2)
        stage.bias.zero_()
    xs = [torch.ones(1, 3, dtype=torch.float64, device="cpu") * (i + 1) for i in range(3)]
    loss, stats = gw.pipeline.pipeline_step(stage, grid, xs, xs, lambda o, t: o.sum(), (1, 3), dtype=torch.float64)
    out["pipeline_loss"] = None if loss is None else loss.item()
    out["forwards"] = stats.forwards
    with open(os.path.join(os.environ["RESULTS"], f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)  # a file per rank: mpirun may interleave the ranks' stdout
''')


def test_gridweave_on_mpi_under_mpirun(tmp_path):
    script = tmp_path / "on_mpi.py"
    script.write_text(SCRIPT)
    r = mpirun(4, [str(script)], 180, RESULTS=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(4)]
    assert [d["rank"] for d in res] == [0, 1, 2, 3] and all(d["world"] == 4 for d in res)
    for d in res:
        assert d["tp_sum"] == sum(d["tp_ranks"])           # the rank's own tp line
        assert d["dp_gather"] == [float(k) for k in d["dp_ranks"]]
        assert d["err"] < 1e-10 and d["recv_any"] and d["backend"] == "mpi"
    assert [d["sub"] for d in res[:2]] == [[2.0, 2.0]] * 2
    for d in res[2:]:
        assert "outside the grid's world of the first 2 ranks" in d["sub"], d["sub"]
    # 4 stages of y = 2x, loss = sum: the last stage sees 16 * (1 + 2 + 3) * 3 over 3 microbatches
    last = [d for d in res if d["pipeline_loss"] is not None]
    assert len(last) == 1 and last[0]["pipeline_loss"] == pytest.approx(16 * 6 * 3 / 3)
    assert all(d["forwards"] == 3 for d in res)


LOW_THREAD_LEVEL = textwrap.dedent('''
    import os
    import mpi4py
    mpi4py.rc.thread_level = "single"  # a host application that initialised MPI without threads
    from mpi4py import MPI
    import gridweave as gw
    try:
        gw.init(dp=MPI.COMM_WORLD.size, backend="mpi", timeout=30.0)
        said = "no error"
    except gw.GridError as e:
        said = f"GridError: {e}"
    # a file per rank: mpirun may interleave the ranks' stdout on one line
    with open(os.path.join(os.environ["RESULTS"], f"rank{MPI.COMM_WORLD.rank}.txt"), "w") as f:
        f.write(said)
''')


def test_an_mpi_without_enough_thread_support_is_a_clear_error(tmp_path):
    """Someone else initialised MPI at MPI_THREAD_SINGLE: gridweave's async ops need
    SERIALIZED or better, so gw.init refuses with what is missing, before any message."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "low.py"
    script.write_text(LOW_THREAD_LEVEL)
    r = mpirun(2, [str(script)], 120, RESULTS=str(tmp_path))
    assert all((tmp_path / f"rank{k}.txt").exists() for k in range(2)), r.stdout[-2000:] + r.stderr[-2000:]
    for ln in [(tmp_path / f"rank{k}.txt").read_text() for k in range(2)]:
        assert ln.startswith("GridError") and "MPI_THREAD_SERIALIZED" in ln, ln
