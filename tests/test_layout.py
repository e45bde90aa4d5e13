"""The package layout shows the architecture, and the README's table says so.

proxy/ is packages by concern, whose imports point one way::

    ingress -> dataplane -> control -> upstream -> telemetry -> core

(the entry points ``cli``, ``admin_cli``, ``supervisor`` and ``server`` sit
above them all). A package may import its own modules and those of packages
to its right, never to its left, and none imports an entry point. Imports
under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are not
counted.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["ingress", "dataplane", "control", "upstream", "telemetry", "core"]
ENTRY_POINTS = {"proxy", "proxy.__main__", "proxy.cli", "proxy.admin_cli"}
ENTRY_POINTS |= {"proxy.supervisor", "proxy.server"}
# Modules in the longest import chain, from ``proxy.cli`` down (``python -m
# proxy``'s five-line shim above it is not counted).
MAX_CHAIN = 10


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted((ROOT / "proxy").rglob("*.py"))}


def _imports(name: str) -> set[str]:
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    visit([s for s in sub if isinstance(s, ast.stmt)])

    visit(ast.parse(MODULES[name].read_text()).body)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_is_in_a_layer_or_an_entry_point() -> None:
    loose = [m for m in MODULES if _layer(m) is None and m not in ENTRY_POINTS]
    assert not loose, f"modules outside the packages: {loose}"


def test_imports_point_one_way() -> None:
    wrong = []
    for name, deps in GRAPH.items():
        here = _layer(name)
        if here is None:
            continue
        for dep in deps:
            there = _layer(dep)
            if there is None or LAYERS.index(there) < LAYERS.index(here):
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle() -> None:
    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import cycle: " + " -> ".join((*path, name))
        for dep in GRAPH[name]:
            if not _is_package_of(dep, name):
                visit(dep, (*path, name))

    for name in MODULES:
        visit(name, ())


@functools.cache
def _longest(name: str) -> tuple[str, ...]:
    below = [_longest(dep) for dep in GRAPH[name] if not _is_package_of(dep, name)]
    return (name, *max(below, key=len, default=()))


def _is_package_of(dep: str, name: str) -> bool:
    # Importing proxy.core.x runs proxy/core/__init__.py too; that is no hop.
    return name.startswith(dep + ".")


def test_the_longest_import_chain_is_short() -> None:
    chain = max((_longest(m) for m in MODULES if m != "proxy.__main__"), key=len)
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_layout_table_lists_every_module() -> None:
    table = _layout_table()
    named = set(re.findall(r"`([\w/.]+)`", table))
    missing = []
    for path in sorted(p for p in (ROOT / "proxy").rglob("*.py") if p.name != "__main__.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            rel = rel.removesuffix("__init__.py")
        if rel not in named:
            missing.append(rel)
    assert not missing, f"README's layout table does not list: {missing}"
    stale = [p for p in named if p.startswith("proxy/") and not (ROOT / p).exists()]
    assert not stale, f"README's layout table lists what is gone: {stale}"
