"""How ranks are spawned on one machine: torchrun (Gloo, NCCL) or mpirun (the MPI transport),
and which is the default. The CLI, the benchmarks and the tests ask here."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from . import _C
from .errors import GridError

LAUNCHERS = ("torchrun", "mpirun")
# What mpirun (OpenMPI, MPICH/Hydra, PMIx) and srun put in a rank's environment.
_MPI_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID")


def _env_int(name: str):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def mpi_installed() -> bool:
    """gridweave was built with the MPI transport and an mpirun is on PATH."""
    return bool(_C.mpi_available) and shutil.which("mpirun") is not None


def mpi_launched() -> bool:
    """An MPI launcher (mpirun, srun) started this process."""
    return any(k in os.environ for k in _MPI_LAUNCHED)


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
    else torchrun's WORLD_SIZE (1 when there is none)."""
    if backend == "mpi" and _C.mpi_available and mpi_launched():
        return mpi_world()[1]
    return _env_int("WORLD_SIZE") or 1


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


def mpirun_command(n: int, quiet: bool = False) -> list:
    """mpirun -np n, with what OpenMPI needs as root and with more ranks than cores; quiet:
    without OpenMPI's own banner when a rank fails (the ranks say what went wrong)."""
    exe = shutil.which("mpirun")
    if exe is None:
        raise GridError("the mpirun launcher: no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    openmpi = "Open MPI" in version  # OpenMPI refuses root and more ranks than cores without these
    flags = ((["--allow-run-as-root"] if os.geteuid() == 0 else []) + ["--oversubscribe"] +
             (["-q"] if quiet else [])) if openmpi else []
    return [exe, *flags, "-np", str(n)]


def torchrun_command(n: int, port: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={port}"]


def command(launcher: str, n: int, port: int, quiet: bool = False) -> list:
    """The prefix that starts n ranks of a Python program: append the script and its args."""
    if launcher not in LAUNCHERS:
        raise GridError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    return mpirun_command(n, quiet) + [sys.executable] if launcher == "mpirun" else torchrun_command(n, port)
