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


# ---- the Python package: one direction of imports (issue 29) ------------------------------
import ast  # noqa: E402

PKG = ROOT / "python" / "gridweave"
# Bottom first. A module may import its own layer's modules (without a loop) and any layer
# below; the package faces (__init__.py) re-export and may import their own package.
LAYERS = (
    ("base", {"_C", "errors", "launch", "_buffers", "_init", "axes", "precision", "measure", "flight", "schedules", "split", "float8"}),
    ("layout", {"layout", "documents"}),
    ("grid", {"grid", "sharding", "ring"}),
    ("beside models (pipeline, optim, zero, checkpoint: sharding, layout and grid only)",
     {"pipeline", "optim", "zero", "checkpoint"}),
    ("autograd", {"autograd"}),
    ("nn", {"nn"}),
    ("modes", {"modes"}),
    ("models", {"models", "hf"}),
    ("plan", {"plan", "recorder", "_plan_worker"}),
    ("jobs (the run's logs and record beside the jobs that write them)",
     {"config", "autogrid", "train", "calibrate", "generate", "data", "loggers", "runfolder", "configfile", "verify"}),
    ("cli", {"cli", "__main__"}),
)
LEVEL = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def _module_name(path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("gridweave",) + parts)


def _targets(node, module, is_package):
    """The gridweave modules an import statement names (resolved relative imports)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "gridweave"]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    if stem.split(".")[0] != "gridweave":
        return []
    # `from . import x` names submodule x; `from .m import name` names m
    return [f"{stem}.{a.name}" if node.module is None else stem for a in node.names]


def _imports():
    """(module, target, line, at module level) for every import of gridweave code."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        module, tree = _module_name(path), ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If)
                                                 for n in s.body + s.orelse}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, module, path.name == "__init__.py"):
                    found.append((module, t, node.lineno, id(node) in top_level))
    return found


def _level(module):
    parts = module.split(".")
    return LEVEL.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    missing = sorted({m for m, *_ in _imports()} - {"gridweave"} - {m for m, *_ in _imports() if _level(m) is not None})
    assert not missing, f"modules outside LAYERS: {missing}"


def test_no_import_is_hidden_in_a_function():
    hidden = [f"{m}:{line} imports {t}" for m, t, line, top in _imports() if not top]
    assert not hidden, hidden


def test_imports_point_down():
    """Nothing imports a layer above its own: the grid knows axes and degrees, not modes or
    layers; nothing below modes imports modes; the planner imports no job."""
    up = []
    for m, t, line, _ in _imports():
        if m == "gridweave" or t == "gridweave":
            if t == "gridweave" and m != "gridweave":
                up.append(f"{m}:{line} imports the package face")
            continue
        same_package_face = m.endswith(".__init__") or (m.count(".") == 1 and t.startswith(m + "."))
        if _level(t) > _level(m) and not same_package_face:
            up.append(f"{m}:{line} ({LAYERS[_level(m)][0]}) imports {t} ({LAYERS[_level(t)][0]})")
    assert not up, up


def test_no_import_loops():
    graph = {}
    for m, t, _, _ in _imports():
        graph.setdefault(m, set()).add(t)
    # a target may be a name inside a module (`from .m import name`): keep modules only
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    graph = {m: {t if t in modules else t.rsplit(".", 1)[0] for t in ts} & modules for m, ts in graph.items()}
    loops, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if t == m or (m == "gridweave"):
                continue
            if state.get(t) == "open":
                loops.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # a package's face importing its own parts is not a loop unless a part imports the face back
    assert not loops, loops


def test_models_never_import_hf():
    bad = [f"{m}:{line}" for m, t, line, _ in _imports()
           if m.startswith("gridweave.models.") and m != "gridweave.models.hf" and ".hf" in t]
    assert not bad, bad
