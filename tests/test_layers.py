"""The import graph of ``src/rayslice`` follows the layer order, with no cycles.

Layers (each may import only from layers below it, or from its own layer
without cycles): pure facts and values → cluster inventory → planning →
placement → gangs → metrics → data → train / serve → tools → entry points.
Function-local imports count as much as module-level ones: a lazy import
that runs upward is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rayslice"

# Lowest first. A module not listed here makes the test fail: place new modules deliberately.
LAYERS: list[tuple[str, ...]] = [
    ("rayslice.errors", "rayslice._validate", "rayslice._deadline", "rayslice.topology", "rayslice.request"),
    ("rayslice.cluster",),
    ("rayslice.planning",),
    ("rayslice._progress", "rayslice._groups", "rayslice.placement"),
    ("rayslice.gang", "rayslice.warm", "rayslice.dispatch"),
    ("rayslice.metrics",),
    ("rayslice.data",),
    ("rayslice.train", "rayslice.train.elastic", "rayslice.serve"),
    (
        "rayslice.serve.llm",
        "rayslice.profiler",
        "rayslice.sim",
        "rayslice.sim_spec",
        "rayslice._quiet_ray",
        "rayslice.k8s",
    ),
    ("rayslice._tables", "rayslice._demo_model", "rayslice.demo", "rayslice.cli", "rayslice"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The rayslice module ``name`` refers to (a module, or the package holding a name)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from rayslice.train import worker" imports the submodule rayslice.train.worker.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "rayslice" or name.startswith("rayslice."):
                target = _resolve(name, modules)
                if target and target != module:
                    found.add(target)
    return found


def _layer(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the most specific entry wins
    for rank, group in enumerate(LAYERS):
        for prefix in group:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


GRAPH = {m: _imports(m, p, _modules()) for m, p in _modules().items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_runs_up_the_layers(module):
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module) and module != "rayslice")
    assert upward == [], f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_no_import_cycles():
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    # A package's __init__ re-exporting its submodules while they import siblings
    # through the package is the one allowed pattern; anything else is a cycle.
    assert cycles == [], f"import cycles: {cycles}"


def test_private_helpers_live_in_the_package_they_serve():
    top_private = [m for m in GRAPH if m.count(".") == 1 and m.split(".")[1].startswith("_")]
    for module in top_private:
        users = {m.rpartition(".")[0] if m.count(".") > 1 else m for m, deps in GRAPH.items() if module in deps}
        packages = {u for u in users if u.count(".") >= 1 and (SRC / u.split(".")[1]).is_dir()}
        assert not (len(users) >= 1 and users == packages and len(packages) == 1), (
            f"{module} serves only {packages}: move it into that package"
        )


def test_the_graph_sees_known_edges():
    # Guards the test itself: if parsing broke, every assertion above would pass vacuously.
    assert "rayslice.topology" in GRAPH["rayslice.planning"]
    assert "rayslice.gang" in GRAPH["rayslice.profiler"]
    assert len(GRAPH) > 30
