"""The package's import graph, read with `ast` (lazy imports inside functions included).

Rules: no import cycle; `nemo_jetrl.fp8` imports nothing else of the package; `nemo_jetrl.arch`
imports only `nemo_jetrl.fp8.spec`; at most 8 top-level modules beside `__init__.py`; no module
over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nemo_jetrl"
MAX_TOP_LEVEL = 8
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an import of ``name`` loads (``a.b.c`` -> ``a.b`` if c is a name)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for name in names:
            target = _resolve(name, modules) if name.startswith("nemo_jetrl") else None
            if target and target != mod:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for m in graph:
        parent = m.rpartition(".")[0]
        if parent:
            graph[m].add(parent)
    for m in graph:
        graph[m].discard(m)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                return [*stack[stack.index(nxt) :], nxt]
            if color[nxt] == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges module -> module, with a package's ``__init__`` re-exports not counted as a cycle.

    ``pkg/__init__.py`` re-exporting ``pkg.sub`` while ``pkg.sub`` is loaded through ``pkg``
    is how Python packages work, not a cycle between modules; every other edge counts.
    """
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def test_no_import_cycle():
    cycle = _find_cycle(_without_package_inits(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_fp8_imports_nothing_else_of_the_package():
    outside = {
        (m, t)
        for m, targets in _graph().items()
        if m.startswith("nemo_jetrl.fp8")
        for t in targets
        if t != "nemo_jetrl" and not t.startswith("nemo_jetrl.fp8")
    }
    assert not outside, sorted(outside)


def test_at_most_eight_top_level_modules():
    top = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(PKG.parent)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_arch_is_a_leaf_beside_fp8():
    """Model descriptions (`nemo_jetrl.arch`) are read by config, flow and the backends; they
    import only `nemo_jetrl.fp8.spec` (the block size), so no family can pull config or flow
    logic in (or a cycle through them)."""
    outside = {
        (m, t)
        for m, targets in _graph().items()
        if m.startswith("nemo_jetrl.arch")
        for t in targets
        if t not in ("nemo_jetrl", "nemo_jetrl.fp8", "nemo_jetrl.fp8.spec")
        and not t.startswith("nemo_jetrl.arch")
    }
    assert not outside, sorted(outside)
