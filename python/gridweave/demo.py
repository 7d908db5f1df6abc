"""Main job until the training issue lands: segmented collectives on a dp x 3-D grid.

    torchrun --nproc-per-node 8 -m gridweave.demo

Every rank checks its results against a numpy reference and prints its traffic.
"""
from __future__ import annotations

import numpy as np
import torch

import gridweave as gw


def main() -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    p = 2 if world % 8 == 0 else 1
    grid = gw.init(dp=world // p**3, tp=gw.Cube(p), placement="topology",
                   ranks_per_node=max(1, world // 2))  # emulate 2 nodes
    t = torch.full((4, 3), float(grid.rank))
    out = grid.all_gather(t, axis="y")
    ref = np.concatenate([np.full((4, 3), r, np.float32) for r in grid.ranks("y")])
    assert np.array_equal(out.numpy(), ref), "all_gather mismatch"
    work = grid.reduce_scatter(torch.ones(8, 5), axis=("x", "z"), async_op=True)
    red = work.wait()
    assert torch.equal(red, torch.full((8 // grid.size(("x", "z")), 5), float(grid.size(("x", "z")))))
    total = grid.all_reduce(torch.tensor([float(grid.rank)]), axis=None)
    assert total.item() == sum(range(grid.world_size))
    s = grid.stats()
    if grid.rank == 0:
        print(grid)
        for axis, c in sorted(s.items()):
            print(f"  axis {axis:6s} ops={c['ops']} sent intra={c['sent_intra']['bytes']}B "
                  f"inter={c['sent_inter']['bytes']}B")
        m = grid.traffic("y", "all_gather", t.numel() * 4)
        print(f"  SUPER model, all_gather on y: {m}")
        print("demo OK: all_gather, reduce_scatter and all_reduce match numpy on every rank")
    gw.shutdown()


if __name__ == "__main__":
    main()
