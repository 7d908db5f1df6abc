"""A worker of gw.plan.plan(workers=N): a JSON job on stdin (the model, cluster, options and
runs of grid specs), the predicted rows of each run as JSON on stdout."""
import json
import sys

from gridweave.plan import _worker_main

if __name__ == "__main__":
    json.dump(_worker_main(json.load(sys.stdin)), sys.stdout)
