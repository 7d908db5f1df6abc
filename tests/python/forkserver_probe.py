"""A program for launch.torchrun's test: each rank writes where its module was imported and who
its parent is, and exits with the code its argument names."""
import json
import os
import sys

import torch  # noqa: F401 (imported by the fork server, once)

IMPORTED_IN = os.getpid()


def main(argv):
    out, code = argv
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "imported_in": IMPORTED_IN,
                   "world": int(os.environ["WORLD_SIZE"])}, f)
    return int(code) if rank == 1 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
