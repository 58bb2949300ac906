"""The import graph of rakv/ and app/ has no circles, and the engine never imports Qt.

Every import counts, also those inside functions (a lazy import is still a dependency: it only
hides a circle), and ``from P import x`` is an edge to P's __init__ even from a module inside P (it
reads P's namespace); ``from .x import name`` and ``import P.x`` name the submodule instead.
Run ``python tests/unit/test_layers.py`` to print the graph's layers bottom-up.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast      # the whole file is in the fast subset (docs/contributing.md#tests)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rakv", "app")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``mod`` imports (anywhere in the file), by their dotted names."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node.level, node.module)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            if base in known and base != mod:    # `from P import x` reads P's namespace (its
                out.add(base)                    # __init__), also when P is mod's own package
        for n in names:
            while n and n not in known:          # a name inside a module: the module itself
                n = n.rpartition(".")[0]
            while n:                             # importing a.b runs a/__init__.py first
                if n in known and n != mod and not mod.startswith(n + "."):
                    out.add(n)
                n = n.rpartition(".")[0]
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layers(g: dict[str, set[str]]) -> list[list[str]]:
    """Modules by height: layer 0 imports no project module, layer n only those below n."""
    height: dict[str, int] = {}

    def h(v: str) -> int:
        if v not in height:
            height[v] = 0
            height[v] = 1 + max((h(w) for w in g[v]), default=-1)
        return height[v]

    for v in g:
        h(v)
    out: list[list[str]] = [[] for _ in range(max(height.values()) + 1)]
    for v, n in height.items():
        out[n].append(v)
    return [sorted(x) for x in out]


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_circle_is_found():
    """The checker itself: a made-up two-module circle and a self-contained chain."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_lazy_imports_count(tmp_path):
    """An import inside a function is an edge like any other."""
    src = "def f():\n    from .b import x\n    import rakv.c\n"
    p = tmp_path / "a.py"
    p.write_text(src)
    known = {"rakv.a": p, "rakv.b": p, "rakv.c": p}
    assert imports_of("rakv.a", p, known) == {"rakv.b", "rakv.c"}


def test_from_package_import_is_an_edge_to_the_package(tmp_path):
    """``from . import x`` and ``from pkg import x`` read the package's namespace: an edge to its
    __init__, also from inside the package, so a package whose __init__ imports such a submodule is
    a circle; ``from .x import name`` and ``import pkg.x`` name the submodule and are not."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    files = {"__init__.py": "def run():\n    from .report import write\n",
             "report.py": "from . import metrics as M\n", "metrics.py": "",
             "plots.py": "from p import metrics\n", "table.py": "from .metrics import median\nimport p.metrics\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    known = {"p": pkg / "__init__.py", **{f"p.{n[:-3]}": pkg / n for n in files if n != "__init__.py"}}
    g = {m: imports_of(m, path, known) for m, path in known.items()}
    assert g["p.report"] == {"p", "p.metrics"}
    assert g["p.plots"] == {"p", "p.metrics"}
    assert g["p.table"] == {"p.metrics"}
    assert cycles(g) == [["p", "p.report"]]


def test_engine_never_imports_qt_or_app():
    for m, p in modules().items():
        if not m.startswith("rakv"):
            continue
        text = p.read_text(encoding="utf-8")
        for bad in ("PySide6", "pyqtgraph", "from app", "import app"):
            assert bad not in text, f"{m} mentions {bad}: rakv/ never imports Qt or the GUI"


def test_every_module_says_its_job():
    """Each module opens with a docstring (its one job)."""
    missing = [m for m, p in modules().items()
               if ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) is None]
    assert not missing, f"modules without a docstring: {missing}"


if __name__ == "__main__":
    g = graph()
    for i, layer in enumerate(layers(g)) if not cycles(g) else []:
        print(f"{i:2d}  {' '.join(layer)}")
    for c in cycles(g):
        print("circle:", " <-> ".join(c))
