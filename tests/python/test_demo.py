"""The README's main job runs on 8 CPU ranks and checks itself against numpy."""
import os
import subprocess
import sys


def test_main_job_on_8_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8", "--master-port=29533",
                        "-m", "gridweave.demo"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "demo OK" in r.stdout
