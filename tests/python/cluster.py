"""A cluster of network namespaces (scripts/cluster.sh) driven from Python: the tests' and the
benchmarks' view of it. Each node has its own address, hostname and link; the main job is
started on every node as a user would (the same command, --node-rank apart)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cluster.sh"


def unavailable() -> str | None:
    """Why no cluster can be made here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    r = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"no emulated cluster here: {r.stderr.strip()}"


class Cluster:
    """`n` nodes named PREFIX-node0.. on SUBNET; a context manager that tears them down."""

    def __init__(self, n: int, prefix: str = "gwt", subnet: str = "10.231.78", rate: str | None = None):
        self.n, self.env = n, {**os.environ, "GW_CLUSTER_PREFIX": prefix, "GW_CLUSTER_SUBNET": subnet}
        self.prefix, self.rate = prefix, rate

    def sh(self, *args, check=True) -> str:
        r = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=self.env,
                           timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"cluster.sh {' '.join(map(str, args))}: {r.stderr.strip()}")
        return r.stdout

    def __enter__(self):
        self.sh("down", check=False)  # a cluster a killed run left behind
        self.sh("up", self.n, *(["--rate", self.rate] if self.rate else []))
        return self

    def __exit__(self, *exc):
        self.sh("down", check=False)

    def addr(self, k: int) -> str:
        return self.sh("addr", k).strip()

    def host(self, k: int) -> str:
        return f"{self.prefix}-node{k}"

    def popen(self, k: int, cmd: list, log: Path, env: dict | None = None) -> subprocess.Popen:
        """cmd on node k, its output to `log`."""
        out = open(log, "wb")
        return subprocess.Popen(["bash", str(SCRIPT), "exec", str(k), *map(str, cmd)], stdout=out,
                                stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, cwd=str(ROOT))

    def pids(self, k: int) -> list:
        return [int(p) for p in self.sh("pids", k, check=False).split()]

    def tx_bytes(self, k: int) -> int:
        """Bytes node k has sent on its link (the kernel's counter)."""
        r = subprocess.run(["ip", "netns", "exec", f"{self.prefix}-node{k}", "cat",
                            "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True, check=True)
        return int(r.stdout)

    def worker_pids(self, k: int) -> list:
        """The ranks running on node k: mpirun's (gridweave.cli without the launcher's flags on their
        command line) or those torchrun's agent forked from its fork server (launch.torchrun)."""
        def cmdline(p):
            try:
                return Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                return []

        def parent(p):
            try:  # /proc/PID/stat: pid (comm) state ppid ...
                return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                return None

        out = []
        for p in self.pids(k):
            cmd = cmdline(p)
            forked = any(b"multiprocessing.forkserver" in part for part in cmdline(parent(p)))
            if (b"gridweave.cli" in cmd and b"--nnodes" not in cmd) or forked:
                out.append(p)
        return sorted(out)

    def wait_empty(self, timeout: float) -> float | None:
        """Seconds until no process is left on any node (None: some still are after `timeout`)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not any(self.pids(k) for k in range(self.n)):
                return time.monotonic() - t0
            time.sleep(0.2)
        return None


def train_cmd(nodes, k: int, master: str, port: int, nproc: int, args: list) -> list:
    """`gridweave train` as node k of `nodes` runs it."""
    return [sys.executable, "-m", "gridweave.cli", "train", "--nnodes", nodes, "--node-rank", k, "--master-addr",
            master, "--master-port", port, "--nproc", nproc, "--launcher", "torchrun", *args]


def bench_setup(parser, name: str) -> tuple:
    """A cluster benchmark's arguments (its parser's, and --rate: each node's link) and its empty
    work folder, /tmp/gridweave-<name>; exits saying why where no cluster can be made here."""
    parser.add_argument("--rate", default="200mbit", help="each node's link, both ways (tbf)")
    args = parser.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"{name}: {why}")
    work = Path("/tmp") / f"gridweave-{name.replace('_', '-')}"
    shutil.rmtree(work, ignore_errors=True)  # --resume auto must not find an earlier run's checkpoint
    work.mkdir(parents=True)
    return args, work
