"""The main job with a fault injected by the test harness (the library knows nothing of it):
`python faulty_train.py RANK:STEP <gridweave train flags>` makes rank RANK die, as a killed
process would, when it reaches step STEP."""
import os
import sys

from gridweave import train
from gridweave.cli import parse_train


def main() -> None:
    rank, step = (int(v) for v in sys.argv[1].split(":"))

    def on_step(s, state):
        if state.grid.rank == rank and s == step:
            os._exit(9)

    train.run(parse_train(sys.argv[2:]), on_step=on_step)


if __name__ == "__main__":
    main()
