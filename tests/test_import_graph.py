"""The package's import graph, read with `ast` (lazy imports inside functions included).

Rules: no import cycle; `nemo_jetrl.fp8` imports nothing else of the package; `nemo_jetrl.arch`
imports only `nemo_jetrl.fp8.spec`; at most 8 top-level modules beside `__init__.py`; no module
over 400 lines; `jetrl compare`'s path imports no torch (it runs in a light venv on a login
node, docs/cluster.md).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
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


def _imported_names(node: ast.AST, mod: str, is_pkg: bool) -> list[str] | None:
    """What an import statement names, absolute (``from a import b``: a.b and a); None if
    ``node`` is not an import."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return None
    if node.level:
        base = mod.split(".")
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" for a in node.names] + [prefix]


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = _imported_names(node, mod, is_pkg)
        if names is None:
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
    import only `nemo_jetrl.fp8.spec` (the block size) and `nemo_jetrl.errors` (which imports
    nothing of the package: a leaf too), so no family can pull config or flow logic in (or a
    cycle through them)."""
    outside = {
        (m, t)
        for m, targets in _graph().items()
        if m.startswith("nemo_jetrl.arch")
        for t in targets
        if t not in ("nemo_jetrl", "nemo_jetrl.fp8", "nemo_jetrl.fp8.spec", "nemo_jetrl.errors")
        and not t.startswith("nemo_jetrl.arch")
    }
    assert not outside, sorted(outside)
    errors = {t for t in _graph().get("nemo_jetrl.errors", ()) if t.startswith("nemo_jetrl.")}
    assert not errors, sorted(errors)  # the leaf arch may import


# ------------------------------------------------------------------ `jetrl compare` without torch

#: torch, and the libraries that import it when imported.
TORCH_LIBS = (
    "torch",
    "safetensors.torch",
    "transformers",
    "vllm",
    "megatron",
    "transformer_engine",
)
#: where `jetrl compare` starts: the console script (which imports every command module and
#: calls its ``add_arguments`` to build the parser) and the command's module.
COMPARE_ENTRY = ("nemo_jetrl.cli", "nemo_jetrl.commands.compare")
#: functions on compare's path that may import torch: they run only to recompute metrics from
#: train_data jsonl, which `runs.logs._torch_to_recompute` asks torch for first (without it: a
#: warning and the run as logged; tests/commands/test_compare_without_torch.py).
TORCH_GATED = {
    "nemo_jetrl.runs.logs": {"_torch_to_recompute"},
    "nemo_jetrl.runs.train_data": {
        "train_data_tensors", "_padded", "_sample_mask", "_rewards", "recompute_step_metrics",
    },
}  # fmt: skip


@dataclass(frozen=True)
class _Site:
    """One import statement (or ``require("module", ...)`` call) of a package module."""

    where: str
    """path:line"""
    names: tuple[str, ...]
    """what it imports (absolute names)"""
    function: str | None
    """the outermost function it runs in (None: at import)"""


def _is_torch_lib(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TORCH_LIBS)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _sites(mod: str, path: Path) -> list[_Site]:
    """Every import of ``mod`` with the function it runs in (``if TYPE_CHECKING:`` left out)."""
    is_pkg = path.name == "__init__.py"
    rel = path.relative_to(PKG.parent)
    out: list[_Site] = []

    def walk(node: ast.AST, func: str | None) -> None:
        names = _imported_names(node, mod, is_pkg)
        if (
            names is None
            and isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "require"
        ):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
        if names is not None:
            out.append(_Site(f"{rel}:{node.lineno}", tuple(names), func))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and func is None:
            func = node.name
        for child in children:
            walk(child, func)

    walk(ast.parse(path.read_text(), str(path)), None)
    return out


class _TorchPath:
    """Which package modules import torch when imported, and why."""

    def __init__(self) -> None:
        self.modules = _modules()
        self.sites = {m: _sites(m, p) for m, p in self.modules.items()}
        self._why: dict[str, str | None] = {}

    def targets(self, site: _Site) -> list[str]:
        """The package modules ``site`` loads (parent packages included)."""
        out: list[str] = []
        for name in site.names:
            t = _resolve(name, self.modules) if name.startswith("nemo_jetrl") else None
            while t and t not in out:
                out.append(t)
                t = t.rpartition(".")[0] or None
        return out

    def offence(self, site: _Site, mod: str) -> str | None:
        """How ``site`` (in ``mod``) imports torch, or None."""
        torch = [n for n in site.names if _is_torch_lib(n)]
        if torch:
            return f"{site.where} imports {torch[0]}"
        for t in self.targets(site):
            if t != mod and (why := self.at_import(t)):
                return f"{site.where} imports {t}, which imports torch when imported: {why}"
        return None

    def at_import(self, mod: str) -> str | None:
        """Why importing ``mod`` imports torch (None: it does not)."""
        if mod not in self._why:
            self._why[mod] = None  # no cycle (test_no_import_cycle); parents are visited first
            parent = mod.rpartition(".")[0]
            why = self.at_import(parent) if parent else None
            for site in self.sites[mod]:
                if why is None and site.function is None:
                    why = self.offence(site, mod)
            self._why[mod] = why
        return self._why[mod]


def _compare_path_torch_imports() -> list[str]:
    """Each import of torch on `jetrl compare`'s path, named: the modules compare loads, every
    function of theirs but the `TORCH_GATED` ones, and what ``jetrl``'s parser loads (every
    command module at import and its ``add_arguments``)."""
    tp = _TorchPath()
    found: list[str] = []
    commands = [
        m
        for m in tp.modules
        if m.startswith("nemo_jetrl.commands.") and not m.rpartition(".")[2].startswith("_")
    ]
    for mod in commands:
        for site in tp.sites[mod]:
            if site.function in (None, "add_arguments") and (why := tp.offence(site, mod)):
                found.append(f"`jetrl` builds its parser from {mod}: {why}")
    todo, seen = list(COMPARE_ENTRY), set(COMPARE_ENTRY)
    while todo:
        mod = todo.pop()
        gated = TORCH_GATED.get(mod, set())
        for site in tp.sites[mod]:
            if site.function in gated:
                continue
            if why := tp.offence(site, mod):
                found.append(why)
                continue
            for t in tp.targets(site):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
    return sorted(set(found))


def test_jetrl_compare_path_imports_no_torch():
    """`jetrl compare` runs where torch is not installed (issue 46): no module it loads imports
    torch, at import or in a function (bar the jsonl recomputation in `TORCH_GATED`), and the
    CLI's parser (built from every command module) loads none. The real command without torch:
    tests/commands/test_compare_without_torch.py."""
    found = _compare_path_torch_imports()
    assert not found, "torch on the path of `jetrl compare`:\n" + "\n".join(found)
