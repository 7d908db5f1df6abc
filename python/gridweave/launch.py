"""How ranks are spawned, on one machine or many: torchrun (Gloo, NCCL) or mpirun (the MPI
transport), which is the default, and what a rank reads from the launcher that started it.
The CLI, the benchmarks and the tests ask here."""
from __future__ import annotations

import atexit
import importlib
import math
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

from . import _C
from .errors import GridError

LAUNCHERS = ("torchrun", "mpirun")
# What mpirun (OpenMPI, MPICH/Hydra, PMIx) and srun put in a rank's environment.
_MPI_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID")
# ... of which those that make this process one rank of many (srun without --mpi sets only
# SLURM_PROCID, also for one launcher task per node)
_RANK_OF_MANY = ("RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
DEFAULT_PORT = 29561
PORT_ENV = "GRIDWEAVE_PORT"
ELASTIC_ENV = "GRIDWEAVE_ELASTIC"  # set for the ranks of an elastic world (--nnodes MIN:MAX)
HOSTNAME_ENV = "GRIDWEAVE_HOSTNAME"


def _env_int(name: str):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def mpi_installed() -> bool:
    """gridweave was built with the MPI transport and an mpirun is on PATH."""
    return bool(_C.mpi_available) and shutil.which("mpirun") is not None


def mpi_launched() -> bool:
    """An MPI launcher (mpirun, srun) started this process."""
    return any(k in os.environ for k in _MPI_LAUNCHED)


def mpi_ranks() -> bool:
    """This process is a rank an MPI launcher started itself, not one torchrun started (under
    `srun gridweave train --nnodes ...` a node's torchrun ranks still see srun's variables)."""
    return mpi_launched() and "RANK" not in os.environ


def started_as_rank() -> bool:
    """A launcher (torchrun, mpirun, srun --mpi) started this process as one rank of a job, so
    `gridweave train` trains here instead of spawning ranks."""
    return any(k in os.environ for k in _RANK_OF_MANY)


def default_port() -> int:
    return _env_int(PORT_ENV) or DEFAULT_PORT


def address_towards(host: str, port: int = 9) -> str:
    """This node's address on the route to `host` (the master): what the other nodes can reach
    this one at, found by the kernel's routing (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError as e:
        raise GridError(f"no route from this node ({socket.gethostname()}) to the master {host}: {e} (set "
                        f"{HOSTNAME_ENV} to the address other nodes reach this one at)") from None


def advertised_address(all_local: bool) -> str:
    """The address this rank's transport listens on and tells its peers: GRIDWEAVE_HOSTNAME when
    set; loopback when every rank is on this node; else the address on the route to
    MASTER_ADDR (a node with several networks picks the one that reaches the master); the
    hostname when there is no master address (MPI)."""
    given = os.environ.get(HOSTNAME_ENV)
    if given:
        return given
    if all_local:
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR")
    return address_towards(master, _env_int("MASTER_PORT") or 9) if master else socket.gethostname()


@dataclass(frozen=True)
class Nodes:
    """Where a job's ranks run, in torchrun's words: nnodes machines, this one node_rank, each
    starting nproc ranks; the master (node 0) at master_addr:master_port serves the
    rendezvous store; a rank lost restarts every node's ranks up to max_restarts times. With
    min_nodes below nnodes the world is elastic (torchrun's --nnodes MIN:MAX, its c10d
    rendezvous): a restart runs on the nodes that come, MIN to MAX, node ranks as they arrive."""
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    max_restarts: int = 0
    min_nodes: int | None = None  # torchrun's --nnodes MIN:MAX: an elastic world of MIN to nnodes nodes

    def __post_init__(self):
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nnodes)
        for name in ("nproc", "nnodes", "min_nodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GridError(f"{name} must be a positive integer, got {v!r}")
        if self.min_nodes > self.nnodes:
            raise GridError(f"nnodes {self.min_nodes}:{self.nnodes}: MIN is above MAX")
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise GridError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise GridError(f"master_port must be a TCP port (1-65535), got {self.master_port!r}")
        if not (isinstance(self.max_restarts, int) and self.max_restarts >= 0):
            raise GridError(f"max_restarts must be a non-negative integer, got {self.max_restarts!r}")
        if not self.master_addr:
            raise GridError("master_addr must name the master node (its address or hostname)")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def elastic(self) -> bool:
        """Whether the world may shrink to min_nodes and grow back (torchrun's c10d rendezvous)."""
        return self.min_nodes < self.nnodes

    def worlds(self) -> range:
        """Every world size the job may run on: nproc ranks on each of min_nodes to nnodes nodes."""
        return range(self.nproc * self.min_nodes, self.world_size + 1, self.nproc)


def node_range(value) -> tuple:
    """torchrun's --nnodes: N, or MIN:MAX (an elastic world), as (MIN, MAX) integers."""
    text = str(value).strip()
    low, colon, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if colon else low)
    except ValueError:
        raise GridError(f"nnodes must be N or MIN:MAX (positive integers), got {value!r}") from None
    return lo, hi  # their bounds: Nodes


def local_world_size():
    """Ranks on this node, as torchrun, OpenMPI, MPICH or srun say (None: no launcher says)."""
    return _env_int("LOCAL_WORLD_SIZE") or _env_int("OMPI_COMM_WORLD_LOCAL_SIZE") or _env_int("MPI_LOCALNRANKS") \
        or _env_int("SLURM_NTASKS_PER_NODE")


def local_rank() -> int:
    """This rank's index on its node, as torchrun, OpenMPI, MPICH or srun say (0 by default)."""
    return (_env_int("LOCAL_RANK") or _env_int("OMPI_COMM_WORLD_LOCAL_RANK") or _env_int("MPI_LOCALRANKID")
            or _env_int("SLURM_LOCALID") or 0)


def mpi_world() -> tuple:
    """Under mpirun / srun: initialise MPI (unless someone did: mpi4py, a host application) and
    return (this rank, world size). MPI_Init is collective over every rank of the job, so a
    program whose grid is only the first ranks calls this on all of them first; gridweave
    finalises at exit what it initialised. Checked before MPI is touched: gridweave has MPI,
    and a launcher started this process."""
    if not _C.mpi_available:
        raise GridError("backend 'mpi' requested but gridweave was built without MPI (install an MPI, e.g. "
                        "apt-get install libopenmpi-dev, and rebuild)")
    if not mpi_launched():
        raise GridError("backend 'mpi' needs its ranks started by an MPI launcher: run under mpirun or srun "
                        f"(none of {', '.join(_MPI_LAUNCHED)} is set)")
    return tuple(_C.mpi_world())


def launched_world_size(backend: str = "auto") -> int:
    """How many ranks the launcher started: MPI's world under mpirun/srun for backend "mpi",
    else torchrun's WORLD_SIZE (srun's SLURM_NTASKS; 1 when there is none)."""
    if backend == "mpi" and _C.mpi_available and mpi_launched():
        return mpi_world()[1]
    return _env_int("WORLD_SIZE") or _env_int("SLURM_NTASKS") or 1


def launched_rank():
    """This process's rank as its launcher says: torchrun's RANK, else srun's SLURM_PROCID."""
    rank = _env_int("RANK")
    return rank if rank is not None else _env_int("SLURM_PROCID")


def store_generation() -> int:
    """What keeps a start's keys apart from an earlier start's in the store its ranks meet in:
    torchrun's restart count where the agents' store outlives a start (it serves the ranks), 0
    where each start's rank 0 serves a fresh store (an elastic world, TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
    there the agents' counts differ (a node that joined late counts none), and nothing is left over."""
    return restart_count() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def elastic_world() -> bool:
    """Whether this rank's launcher runs an elastic world (torchrun's --nnodes MIN:MAX through
    gridweave's launcher): a world it may restart on smaller or larger than the job was given."""
    return os.environ.get(ELASTIC_ENV) == "1"


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job's ranks (0: the first start; what
    keeps a start's store keys apart is store_generation, which reads it where that is needed)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT") or 0


def default_launcher(device: str = "auto", backend: str = "auto") -> str:
    """The launcher a transport needs (mpirun for "mpi", torchrun for "gloo" / "nccl"); for
    "auto" on a CPU machine the fastest installed transport: MPI's shared memory (a 64 KiB
    4-rank all_reduce in 0.4 ms against Gloo's 3-5 ms over TCP loopback,
    benchmarks/results/transports.json); with GPUs torchrun (NCCL, or Gloo sharing them)."""
    import torch

    if backend != "auto":
        return "mpirun" if backend == "mpi" else "torchrun"
    gpus = device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() > 0
    return "mpirun" if (mpi_installed() and not gpus) else "torchrun"


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent (the launcher) dies, so no rank
    trains on, or writes, after the job was killed; exits now if the parent is already gone."""
    import ctypes
    import signal

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


# What a rank started on another node by mpirun must see of the launcher's environment
# (OpenMPI forwards nothing over rsh/ssh unless told): gridweave's settings and Python's paths.
_FORWARD = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "OMP_NUM_THREADS", "VIRTUAL_ENV")


def mpirun_command(n: int, quiet: bool = False, hostfile: str | None = None, per_node: int | None = None) -> list:
    """mpirun -np n, with what OpenMPI needs as root and with more ranks than cores; quiet:
    without OpenMPI's own banner when a rank fails (the ranks say what went wrong); hostfile:
    the ranks over its nodes, per_node on each in order (ranks of a node consecutive, as
    torchrun numbers them), with gridweave's environment forwarded to them."""
    exe = shutil.which("mpirun")
    if exe is None:
        raise GridError("the mpirun launcher: no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    openmpi = "Open MPI" in version  # OpenMPI refuses root and more ranks than cores without these
    flags = ((["--allow-run-as-root"] if os.geteuid() == 0 else []) + ["--oversubscribe"] +
             (["-q"] if quiet else [])) if openmpi else []
    if hostfile is not None:
        if not os.path.isfile(hostfile):
            raise GridError(f"hostfile={hostfile} is not a file (mpirun's list of nodes, one per line)")
        names = sorted(k for k in os.environ if k in _FORWARD or k.startswith("GRIDWEAVE_"))
        if openmpi:
            flags += ["--hostfile", hostfile] + (["--map-by", f"ppr:{per_node}:node"] if per_node else [])
            flags += [x for k in names for x in ("-x", k)]
        else:  # MPICH / Hydra
            flags += ["-f", hostfile] + (["-ppn", str(per_node)] if per_node else []) + \
                     (["-genvlist", ",".join(names)] if names else [])
    return [exe, *flags, "-np", str(n)]


def run_module(module: str, argv: list) -> int:
    """One rank of `python -m module argv`, in a process forked from a server that imported the
    module once (torchrun's forkserver start method): the module's main(argv) runs, its exit code
    is the process's, and the interpreter's exit handlers run as at a normal exit (a forked process
    leaves through os._exit)."""
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
    atexit._run_exitfuncs()
    if code:
        sys.exit(code)
    return 0


def _fork_server(module: str) -> None:
    """Start multiprocessing's fork server with `module` (and torch) imported, once per process.
    Each child re-runs the parent's main module as __mp_main__ (multiprocessing's fixup); where
    that module was run with -m it is already imported in the server, which runpy warns about on
    every rank's stderr: silenced in the server alone (its -W options are the parent's)."""
    multiprocessing.set_forkserver_preload([module])
    saved = sys.warnoptions[:]
    sys.warnoptions.append("ignore::RuntimeWarning:runpy")
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        sys.warnoptions[:] = saved


ELASTIC_LAST_CALL_S = 5  # an elastic rendezvous waits this long past MIN nodes for more (torchrun's: 30)


def torchrun(nodes: Nodes, module_argv: list, run_id: str, timeout: float) -> int:
    """This node's share of a job through torchrun's elastic agent, in this process: nodes.nproc
    ranks of `python -m <module_argv>` (the module's main(argv)), a static rendezvous at the master
    (node ranks as given, so node k holds ranks k*nproc ... as the placement assumes; an elastic
    world's c10d rendezvous numbers the nodes as they come, each still holding consecutive ranks),
    restarts as nodes says. The ranks
    are forked from one server that imported the module (torch included) once, rather than each
    importing it afresh: on a node whose ranks share few cores the imports were most of a short
    job's start. Returns the first failed rank's exit code (0: all finished). The agent's own
    failure report is not printed: the ranks have said what went wrong."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # ... nor its stopping the other ranks once one failed (torch.multiprocessing's warning per rank)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    if nodes.elastic:  # c10d: the agents that come make the world (MIN to MAX nodes), node ranks in arrival order
        rdzv = dict(rdzv_backend="c10d", rdzv_configs={"timeout": int(math.ceil(timeout)),
                                                       "last_call_timeout": ELASTIC_LAST_CALL_S})
        # each round's ranks meet in a store of their own (rank 0's, a fresh port): the agents' shared
        # one keeps an earlier round's keys, and the agents' restart counts, which would set them apart,
        # differ once a node restarted for another's loss
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        os.environ[ELASTIC_ENV] = "1"  # the ranks may adjust the micro-batches to the world they get
    else:
        rdzv = dict(rdzv_backend="static", rdzv_configs={"rank": nodes.node_rank, "timeout": int(math.ceil(timeout))})
    config = LaunchConfig(min_nodes=nodes.min_nodes, max_nodes=nodes.nnodes, nproc_per_node=nodes.nproc, run_id=run_id,
                          rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port}", max_restarts=nodes.max_restarts,
                          monitor_interval=0.1, start_method="forkserver", **rdzv)
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    module, *argv = module_argv
    _fork_server(module)
    try:
        elastic_launch(config, run_module)(module, argv)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 1)
    except (DistError, RendezvousError) as e:  # the rendezvous: a node that never came, a master gone
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"gridweave train: node {nodes.node_rank}: the rendezvous at {nodes.master_addr}:{nodes.master_port} "
              f"failed: {first}", file=sys.stderr, flush=True)
        return 1
    return 0


def torchrun_command(n: int, port: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={port}"]


def command(launcher: str, n: int, port: int, quiet: bool = False) -> list:
    """The prefix that starts n ranks of a Python program: append the script and its args."""
    if launcher not in LAUNCHERS:
        raise GridError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    return mpirun_command(n, quiet) + [sys.executable] if launcher == "mpirun" else torchrun_command(n, port)
