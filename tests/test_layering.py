"""The house rules of the package layout (DESIGN.md, docs/architecture.md "Layout and floors"):
no two modules import each other, and no module imports from a floor above its own.

Imports are read with ast from the source (``TYPE_CHECKING`` and function-local imports
count too): a lazy import up a floor is still a leak.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[1] / "devin_compile"

# Bottom up. A module's floor is the first entry whose prefix matches its dotted name.
FLOORS: list[tuple[str, ...]] = [
    ("step", "graph_utils", "graph_experts", "compile_lock", "validation", "text"),
    ("backends",),
    ("ops",),
    ("config", "capture", "pipeline", "weights", "quant", "cache", "compile_cache"),
    ("passes",),
    ("runtime",),
    ("api", "optimized_model", "compile_backend", "dynamic_tokens", "offload", "benchmarking", "models", "serve", ""),
    ("cli",),
]


def floor_of(module: str) -> int:
    rel = module.removeprefix("devin_compile").removeprefix(".")
    best = None
    for i, names in enumerate(FLOORS):
        for name in names:
            if name and (rel == name or rel.startswith(name + ".")):
                return i
            if not name and rel == "":
                best = i
    assert best is not None, f"{module} has no floor in FLOORS: add it"
    return best


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = ["devin_compile", *path.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules ``module`` imports (``from pkg import submodule`` names the submodule)."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("devin_compile"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("devin_compile"))
    out.discard(module)
    return {m for m in out if m in known}


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for m, p in mods.items():
        g.add_node(m)
        for dep in _imports(m, p, set(mods)):
            # a package's __init__ re-exporting its own submodules is not a leak
            if not dep.startswith(m + "."):
                g.add_edge(m, dep)
    return g


def test_no_import_circles(graph):
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_from_a_floor_above(graph):
    up = [f"{a} (floor {floor_of(a)}) imports {b} (floor {floor_of(b)})"
          for a, b in graph.edges if floor_of(b) > floor_of(a)]
    assert not up, "imports that run up a floor:\n" + "\n".join(sorted(up))


def test_passes_never_import_runtime_or_backends(graph):
    bad = [f"{a} -> {b}" for a, b in graph.edges
           if a.startswith("devin_compile.passes") and b.startswith(("devin_compile.runtime", "devin_compile.backends"))]
    assert not bad, bad


def test_runtime_never_imports_a_pass(graph):
    bad = [f"{a} -> {b}" for a, b in graph.edges
           if a.startswith("devin_compile.runtime") and b.startswith("devin_compile.passes")]
    assert not bad, bad


def test_library_never_imports_its_server(graph):
    """The runtime and the OptimizedModel facade work without the HTTP stack: the text layer they
    share with the server lives below both (``devin_compile.text``)."""
    bad = [f"{a} -> {b}" for a, b in graph.edges
           if a.startswith(("devin_compile.runtime", "devin_compile.optimized_model", "devin_compile.text"))
           and b.startswith("devin_compile.serve")]
    assert not bad, bad


def _pass_of(module: str) -> str | None:
    """The pass a module of ``passes/`` belongs to (``passes.attention_to_paged.mla`` → ``attention_to_paged``);
    None for the package itself and for the pass table, which import every pass."""
    parts = module.split(".")
    if parts[:2] != ["devin_compile", "passes"] or len(parts) < 3 or parts[2] == "table":
        return None
    return parts[2]


def test_passes_are_on_one_floor(graph):
    """No pass imports another pass: what passes share lives below them (graph_utils, ops, pipeline)."""
    bad = [f"{a} -> {b}" for a, b in graph.edges
           if _pass_of(a) is not None and b.startswith("devin_compile.passes") and _pass_of(b) != _pass_of(a)]
    assert not bad, "pass modules importing another pass:\n" + "\n".join(sorted(bad))


def test_no_pass_imports_a_private_name():
    """``from .x import _name`` reaches into another module's private helpers; what passes share has
    public names (graph_utils, ops, pipeline), and a pass's own parts too."""
    mods = _modules()
    bad = []
    for module, path in mods.items():
        if not module.startswith("devin_compile.passes"):
            continue
        is_pkg = path.name == "__init__.py"
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = (".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                      if node.level else node.module or "")
            if not target.startswith("devin_compile") or target == module:
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                       and f"{target}.{a.name}" not in mods]
            if private:
                bad.append(f"{module} imports {private} from {target}")
    assert not bad, "\n".join(sorted(bad))


def test_passes_never_call_onednn_directly():
    """oneDNN (``torch.ops.mkldnn``) is a kernel: passes reach it through ``ops.onednn_linear``."""
    bad = [str(p.relative_to(PKG)) for p in (PKG / "passes").rglob("*.py") if "torch.ops.mkldnn" in p.read_text()]
    assert not bad, bad
