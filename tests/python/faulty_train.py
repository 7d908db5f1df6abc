"""The main job with a fault injected by the test harness (the library knows nothing of it):
`python faulty_train.py RANK:STEP <gridweave train flags>` makes rank RANK die, as a killed
process would, when it reaches step STEP; RANK:STEP:nan instead fills its first parameter with NaN
there (a corrupted weight); RANK:STEP:slow makes every forward of its stage from then on 50 ms
longer (a slow device)."""
import os
import sys
import time

import torch

from gridweave import train
from gridweave.cli import parse_train


def main() -> None:
    rank, step, *what = sys.argv[1].split(":")
    rank, step = int(rank), int(step)

    def on_step(s, state):
        if state.grid.rank == rank and s == step:
            if what == ["nan"]:
                with torch.no_grad():
                    next(state.stage.parameters()).fill_(float("nan"))
            elif what == ["slow"]:
                state.stage.register_forward_pre_hook(lambda *a: time.sleep(0.05))
            else:
                os._exit(9)

    train.run(parse_train(sys.argv[2:]), on_step=on_step)


if __name__ == "__main__":
    main()
