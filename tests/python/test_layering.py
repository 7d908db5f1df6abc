"""The engine's layering, read from its sources: the core (cpp/) names no CUDA header and no
cuda/ file (cuda/ registers its transport, memory and kernels with the core's registry), and
no code above the transports branches on a backend's name."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def _includes(path):
    return INCLUDE.findall(path.read_text())


def test_no_core_file_includes_cuda():
    cuda_files = {p.name for p in (ROOT / "cuda").iterdir()}
    edges = [(p.name, inc) for p in sorted((ROOT / "cpp").iterdir()) if p.suffix in (".h", ".cpp")
             for inc in _includes(p) if inc in cuda_files or inc.startswith(("cuda", "nccl", "cub/"))]
    assert not edges, f"cpp/ -> cuda/ edges: {edges}"
    for p in (ROOT / "cpp").iterdir():
        assert "GRIDWEAVE_WITH_NCCL" not in p.read_text(), p.name


def test_cuda_registers_itself():
    reg = (ROOT / "cuda" / "register.cu").read_text()
    for call in ("register_transport(Backend::Nccl", "register_allocator(Device::CUDA", "register_lse_merge("):
        assert call in reg


def test_nothing_branches_on_a_transports_name():
    """Code above a transport asks its capabilities (can_recv_any, ...), never the name it
    reports (Communicator::backend(), grid.backend / comm.backend in Python): the name is for
    messages. Choosing the transport from the user's backend argument is not such a branch."""
    pattern = re.compile(r'backend\(\)\)?\s*[!=]=|[!=]=\s*\w*\.?backend\(\)|\.backend\s*[!=]=|[!=]=\s*\w+\.backend\b')
    offenders = []
    for p in list((ROOT / "cpp").glob("*.cpp")) + list((ROOT / "cuda").glob("*.cu")) + \
            list((ROOT / "python" / "gridweave").rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line) and "Backend::" not in line:  # the typed choice of transport
                offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders
