"""Which coordination a process runs: the backend its settings choose.

Apart from the interface (:mod:`proxy.control.coordination`), so that what reads
leadership and rounds (the admin handlers, recovery) does not import every
backend, etcd's client with it.
"""

from __future__ import annotations

from pathlib import Path

from proxy.control.coordination import Coordination
from proxy.control.coordination.etcd import Etcd
from proxy.control.coordination.flock import FlockFile
from proxy.core.settings import Settings


def for_settings(settings: Settings, run_dir: Path | None = None) -> Coordination:
    """etcd when configured; else flock with a run directory (workers); else memory."""
    if settings.coordination.etcd is not None:
        return Etcd(settings.coordination.etcd, [g.name for g in settings.groups])
    if run_dir is not None:
        return FlockFile(run_dir)
    return Coordination()
