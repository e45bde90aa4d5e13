"""A real etcd for the tests: Debian's etcd-server on free ports, temp data dir."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from proxy.control.coordination.gateway import Client
from tests.conftest import free_port
from tests.optional import unavailable

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


@contextmanager
def etcd_server() -> Iterator[str]:
    """Start etcd; yield its client URL; stop it by PID."""
    if not os.path.exists(ETCD):
        unavailable("etcd", "etcd is not installed")
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="ftproxy-etcd-")
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [ETCD, "--name", "t", "--data-dir", data,
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("etcd did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)


async def stored_json(client: Client, key: str) -> Any:
    """The JSON value under ``key`` (None when absent)."""
    found = await client.get(key)
    return None if found is None else json.loads(found.value)
