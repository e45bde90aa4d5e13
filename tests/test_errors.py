"""The error tree: every ProxyError subclass lives in proxy/core/errors.py and has
its line, under its parent and with its status, in that module's docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from proxy.core import errors
from proxy.core.errors import ProxyError

PROXY = Path(errors.__file__).parent
# A tree line: box-drawing prefix, the class name, its status (or "any").
_LINE = re.compile(r"^(?P<prefix>[\s│├└─]*)(?P<name>[A-Z]\w*)\s+(?P<status>\d{3}|any)\s+\S")


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def _tree(doc: str) -> dict[str, tuple[str | None, str]]:
    """name -> (parent name, status) as the docstring's tree draws them."""
    tree: dict[str, tuple[str | None, str]] = {}
    stack: list[tuple[int, str]] = []  # (column of the name, name) of open ancestors
    for line in doc.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        column = len(match["prefix"])
        while stack and stack[-1][0] >= column:
            stack.pop()
        tree[match["name"]] = (stack[-1][1] if stack else None, match["status"])
        stack.append((column, match["name"]))
    return tree


def _ours() -> list[type]:
    # Classes a test module defines (fakes) are not the product's.
    return [
        c for c in [ProxyError, *_subclasses(ProxyError)] if c.__module__ == "proxy.core.errors"
    ]


def _unlisted(classes: list[type], doc: str) -> list[str]:
    tree = _tree(doc)
    return [c.__name__ for c in classes if c.__name__ not in tree]


def test_docstring_tree_lists_every_error_class() -> None:
    missing = _unlisted(_ours(), errors.__doc__ or "")
    assert not missing, f"add a line to proxy/core/errors.py's docstring tree for {missing}"
    gone = set(_tree(errors.__doc__ or "")) - {c.__name__ for c in _ours()}
    assert not gone, f"the tree names classes that are gone: {gone}"


@pytest.mark.parametrize("cls", _ours(), ids=lambda c: c.__name__)
def test_docstring_line_has_parent_and_status(cls: type[ProxyError]) -> None:
    parent, status = _tree(errors.__doc__ or "")[cls.__name__]
    base = cls.__base__
    assert parent == (None if cls is ProxyError else base.__name__ if base else None)
    if status != "any":  # "any": the status is the one raised with
        assert int(status) == cls.status


def test_tree_check_fails_for_a_class_without_a_line() -> None:
    class Unlisted(ProxyError):  # what a new class without its line looks like
        pass

    assert _unlisted([*_ours(), Unlisted], errors.__doc__ or "") == ["Unlisted"]


def _bases(node: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}


def test_no_error_class_outside_the_errors_module() -> None:
    # By name, to a fixed point: a subclass of a subclass counts too.
    names = {c.__name__ for c in _ours()}
    classes = [
        (path, node)
        for path in sorted(PROXY.rglob("*.py"))
        if path.name != "errors.py" or path.parent != PROXY
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    elsewhere: dict[int, str] = {}
    grew = True
    while grew:
        grew = False
        for path, node in classes:
            if _bases(node) & names and id(node) not in elsewhere:
                elsewhere[id(node)] = f"{path.relative_to(PROXY.parent)}: {node.name}"
                names.add(node.name)
                grew = True
    assert not elsewhere, f"move these into proxy/core/errors.py: {sorted(elsewhere.values())}"
