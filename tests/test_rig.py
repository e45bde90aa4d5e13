"""The real-engine rig's own logic, against stand-in ranks: its ports, and a
warm-up that recovers a group faulted by its first step."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rig.launcher import Rig, RigConfig, rank_command


def _listening(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_port_in_use_is_refused_with_a_clear_error() -> None:
    port = _free_port()
    cfg = RigConfig(ranks=1, base_port=port, pub_base_port=_free_port(), rpc_port=_free_port())
    with _listening(port):
        assert cfg.busy_ports() == [port]
        with pytest.raises(RuntimeError, match=f"ports \\[{port}\\] are in use"):
            Rig(cfg).start()


def test_on_free_ports_moves_every_port_past_a_busy_one() -> None:
    with _listening(0) as busy:
        port = busy.getsockname()[1]
        # Two ranks: HTTP ports port - 1 and port, the second of them busy.
        cfg = RigConfig(ranks=2, base_port=port - 1, pub_base_port=_free_port())
        moved = cfg.on_free_ports(step=1000)
    shift = moved.base_port - cfg.base_port
    # Moved together, by whole steps (ephemeral ports of other tests may be
    # in use too, so not necessarily by one).
    assert shift > 0 and shift % 1000 == 0
    assert moved.pub_base_port - cfg.pub_base_port == shift
    assert moved.rpc_port - cfg.rpc_port == shift


def test_a_config_on_free_ports_stays_as_it_is() -> None:
    cfg = RigConfig(
        ranks=1, base_port=_free_port(), pub_base_port=_free_port(), rpc_port=_free_port()
    )
    assert cfg.on_free_ports() == cfg


class _Group:
    """Ranks whose first completion faults the group (as a first step that
    outlasts the collective bound does) until a retry round brings it back."""

    def __init__(self) -> None:
        self.status = "healthy"
        self.faulted_once = False
        self.retries: list[Any] = []
        self.lock = threading.Lock()


def _handler(group: _Group) -> type[BaseHTTPRequestHandler]:
    class Rank(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: object) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            engines = [{"id": 0, "status": group.status}]
            self._answer(200, {"schema_version": 1, "engines": engines})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/fault_tolerance/apply":
                with group.lock:
                    group.retries.append(body)
                    group.status = "healthy"
                self._answer(202, {"request_id": "r"})
                return
            with group.lock:
                if not group.faulted_once:
                    group.faulted_once, group.status = True, "unhealthy"
            while group.status != "healthy":  # waits inside the engine
                threading.Event().wait(0.05)
            self._answer(200, {"choices": [{"text": "x", "finish_reason": "length"}]})

    return Rank


@pytest.fixture
def faulting_group() -> Iterator[tuple[_Group, int]]:
    group = _Group()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(group))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield group, int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_warm_up_recovers_a_group_its_first_step_faulted(
    faulting_group: tuple[_Group, int],
) -> None:
    group, port = faulting_group
    rig = Rig(RigConfig(ranks=1, base_port=port))
    # Without recovery the warm-up waits forever: run it aside, bounded.
    warming = threading.Thread(target=rig.warm_up, daemon=True)
    warming.start()
    warming.join(timeout=30)
    assert not warming.is_alive(), "the warm-up did not recover the faulted group"
    assert group.faulted_once and group.status == "healthy"
    assert len(group.retries) == 1
    assert group.retries[0]["instruction"] == "retry"
    assert group.retries[0]["request_id"].startswith("rig-warm-up-")


def test_a_one_rank_rig_runs_without_dp_and_ft_flags() -> None:
    # Measured on vLLM 0.32: --data-parallel-rank with DP size 1 fails
    # ("data_parallel_external_lb can only be set when data_parallel_size > 1")
    # and FT without it fails ("Fault tolerance requires external load
    # balancer mode"). A group of two keeps both.
    one = rank_command(RigConfig(ranks=1), 0)
    assert not [a for a in one if a.startswith("--data-parallel") or "fault-tolerance" in a]
    two = rank_command(RigConfig(ranks=2), 1)
    assert "--enable-fault-tolerance" in two and "--fault-tolerance-config" in two
    assert two[two.index("--data-parallel-rank") + 1] == "1"
    assert two[two.index("--data-parallel-size") + 1] == "2"
