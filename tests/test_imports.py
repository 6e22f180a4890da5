"""Imports point down: no cycle between tinyserve_trt's subpackages, no tinyserve_dev.

Every module of ``tinyserve_trt`` is parsed with ``ast`` (not imported, so heavy
and optional dependencies do not matter) and every import is collected - at module
level and inside functions, methods, ``try`` and ``if TYPE_CHECKING`` blocks, since
a function-level import is still an arrow. An arrow from one subpackage (``ops``,
``contracts``, ``export``, ``runtime``, ``calibration``, ``cuda``; a top-level module
counts as its own unit) to another forms the graph that must be acyclic; the
layering it allows is written down in ``tinyserve_trt/contracts/__init__.py``
(``LAYERS``). ``test_walker_sees_function_level_and_relative_imports`` checks the
checker on a throwaway package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tinyserve_trt"
ROOT = "tinyserve_trt"


def module_name(path: Path, package_dir: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package_dir: Path = PACKAGE) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, at any depth of the tree.

    ``from X import Y`` yields both ``X`` and ``X.Y`` (Y may be a submodule); callers
    keep only the names they care about. Relative imports are resolved against the
    module's own package.
    """
    name = module_name(path, package_dir)
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add((target, node.lineno))
            found |= {(f"{target}.{a.name}", node.lineno) for a in node.names if a.name != "*"}
    return sorted(found, key=lambda t: (t[1], t[0]))


def unit_of(module: str) -> str | None:
    """The subpackage (or top-level module) of a tinyserve_trt module; None outside it
    and for the package root itself (``tinyserve_trt/__init__.py`` only re-exports lazily)."""
    parts = module.split(".")
    if parts[0] != ROOT or len(parts) < 2:
        return None
    return parts[1]


def edges(package_dir: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(from unit, to unit) -> ["module:line", ...] for every cross-unit import."""
    known = {module_name(p, package_dir) for p in package_dir.rglob("*.py")}
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        src_mod = module_name(path, package_dir)
        src = unit_of(src_mod)
        if src is None:
            continue
        for target, line in imports_of(path, package_dir):
            if target not in known:  # "from pkg import name" where name is not a module
                continue
            dst = unit_of(target)
            if dst is not None and dst != src:
                where = out.setdefault((src, dst), [])
                if f"{src_mod}:{line}" not in where:
                    where.append(f"{src_mod}:{line}")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative-free DFS, small graphs)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def cycle_report(package_dir: Path = PACKAGE) -> str | None:
    """None when the subpackage graph is acyclic, else the cycle and the imports forming it."""
    found = edges(package_dir)
    graph: dict[str, set[str]] = {}
    for a, b in found:
        graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    if cycle is None:
        return None
    arrows = [f"{a} -> {b} ({', '.join(found[a, b][:3])})" for a, b in zip(cycle, cycle[1:])]
    return "import cycle " + " -> ".join(cycle) + ": " + "; ".join(arrows)


def test_no_cycle_between_subpackages():
    assert cycle_report() is None, cycle_report()


def test_no_tinyserve_dev_import():
    bad = [f"{module_name(p)}:{line} imports {t}" for p in sorted(PACKAGE.rglob("*.py"))
           for t, line in imports_of(p) if t.split(".")[0] == "tinyserve_dev"]
    assert not bad, "tinyserve_trt must not import the dev-only tinyserve_dev: " + "; ".join(bad)


def test_walker_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a cycle made only of a function-level and a relative import is found."""
    pkg = tmp_path / "tinyserve_trt"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "user.py").write_text("from ..low import base\n")
    (pkg / "low" / "base.py").write_text("def f():\n    from tinyserve_trt.high.user import g\n")
    assert set(edges(pkg)) == {("high", "low"), ("low", "high")}
    report = cycle_report(pkg)
    assert report is not None and "tinyserve_trt.low.base:2" in report and "tinyserve_trt.high.user:1" in report
    (pkg / "low" / "base.py").write_text("X = 1\n")
    assert cycle_report(pkg) is None


def test_imports_follow_the_documented_layers():
    """Every cross-subpackage import is one ``contracts.LAYERS`` allows (stricter than acyclic)."""
    from tinyserve_trt.contracts import LAYERS

    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {None}
    assert units == set(LAYERS), f"contracts.LAYERS places {sorted(set(LAYERS))}, the package has {sorted(units)}"
    bad = [f"{a} -> {b} ({', '.join(where[:3])})" for (a, b), where in sorted(edges().items())
           if b not in LAYERS[a]]
    assert not bad, "imports against the layering in tinyserve_trt/contracts/__init__.py: " + "; ".join(bad)
    graph = {a: set(bs) for a, bs in LAYERS.items()}
    assert find_cycle(graph) is None, "contracts.LAYERS itself has a cycle"
    doc = ast.get_docstring(ast.parse((PACKAGE / "contracts" / "__init__.py").read_text())) or ""
    for unit, allowed in LAYERS.items():
        line = next((ln for ln in doc.splitlines() if ln.strip().startswith(unit + " ")), "")
        assert all(a in line for a in allowed), f"the docstring's layering line for {unit} omits {allowed}"
