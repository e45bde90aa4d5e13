"""Config loading, env overrides and the CLI's exit codes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from proxy.cli import EXIT_CONFIG, main
from proxy.core.settings import ConfigError, load_settings

GOOD = """\
listen: {host: 127.0.0.1, port: 8000}
groups:
  - name: dp-a
    ranks:
      - {name: r0, url: "http://127.0.0.1:8400", weight: 2}
      - {name: r1, url: "http://127.0.0.1:8401", weight: 1}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "proxy.yaml"
    p.write_text(text)
    return p


def test_issue_example_config_loads(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, GOOD))
    assert s.listen.port == 8000
    assert [(r.name, r.weight) for r in s.groups[0].ranks] == [("r0", 2), ("r1", 1)]
    assert s.timeouts.poll_interval_s <= 0.5


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTPROXY_LISTEN__PORT", "9123")
    monkeypatch.setenv("FTPROXY_TIMEOUTS__QUEUE_S", "7")
    s = load_settings(write(tmp_path, GOOD))
    assert s.listen.port == 9123 and s.timeouts.queue_s == 7


def test_shipped_configs_are_valid() -> None:
    paths = sorted(Path("config").glob("*.yaml"))
    assert {p.name for p in paths} >= {"proxy.yaml", "example.yaml", "compose.yaml"}
    for path in paths:
        assert load_settings(path).groups[0].ranks, path


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (GOOD.replace("weight: 2", "weight: -1"), "groups.0.ranks.0.weight"),
        (GOOD.replace('"http://127.0.0.1:8400"', "localhost:8400"), "groups.0.ranks.0.url"),
        (GOOD.replace("name: r1", "name: r0"), "unique"),
        (GOOD + "bogus: 1\n", "bogus"),
        ("groups: []\n", "groups"),
        ("listen: [\n", "not valid YAML"),
        (GOOD + "1: 2\n", "keys must be names"),
    ],
)
def test_invalid_config_names_file_and_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_cli_invalid_config_exits_2_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("weight: 2", "weight: lots"))
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == EXIT_CONFIG
    assert "Traceback" not in proc.stderr
    assert str(path) in proc.stderr and "groups.0.ranks.0.weight" in proc.stderr


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(GOOD.encode() + b"# \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(path)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_listen_port_in_use_is_one_line_not_a_traceback(tmp_path: Path, workers: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        text = GOOD.replace("port: 8000", f"port: {port}")
        assert text != GOOD
        proc = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--config", str(write(tmp_path, text)),
             "--workers", workers],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_cli_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == EXIT_CONFIG
    assert "nope.yaml" in capsys.readouterr().err


class _Peer(threading.Thread):
    """A server that answers every connection with ``answer`` (b"": closes at once)."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(daemon=True)
        self.answer, self.sock = answer, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(self.answer)


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", "no JSON object"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", "no JSON object"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"ranks": 1}', "list of ranks"),
        (b"", "cannot reach"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"ranks": [{}]}', "another shape"),
    ],
    ids=["text", "array", "shape", "closed", "fields"],
)
@pytest.mark.parametrize("command", [["status", "--once"], ["retry", "g"]], ids=["status", "retry"])
def test_admin_cli_bad_answers_are_one_line(
    capsys: pytest.CaptureFixture[str], answer: bytes, says: str, command: list[str]
) -> None:
    peer = _Peer(answer)
    peer.start()
    try:
        code = main([*command, "--url", peer.url])
    finally:
        peer.sock.close()
    err = capsys.readouterr().err
    assert code == 1 and says in err and "Traceback" not in err, err


def test_admin_cli_a_url_without_a_scheme_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--once", "--url", "foo"]) == 1
    assert "cannot reach foo" in capsys.readouterr().err
