"""Optional TLS: an HTTPS listener, https:// ranks verified against a CA (with
a client certificate when the rank asks), and config errors at load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
import yaml

from proxy import cli
from proxy.core.settings import ConfigError, Listen, Settings, load_settings
from proxy.core.tls import ListenerTLS
from proxy.ingress.state import TABLE
from tests.conftest import free_port, settings_for
from tests.test_continuity import finishes, read_stream, text_of

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 12, "stream": True}


class Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.ca = trustme.CA()
        self.server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.client = self.ca.issue_cert("ft-proxy")
        self.ca_file = tmp / f"{name}-ca.pem"
        self.server_file = tmp / f"{name}-server.pem"  # key and chain in one file
        self.client_file = tmp / f"{name}-client.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.server.private_key_and_cert_chain_pem.write_to_path(str(self.server_file))
        self.client.private_key_and_cert_chain_pem.write_to_path(str(self.client_file))

    def rank_context(self, client_cert: bool) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server.configure_cert(ctx)
        if client_cert:  # the rank accepts only clients with a certificate of this CA
            self.ca.configure_trust(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        if with_cert:
            self.client.configure_cert(ctx)
        return ctx


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return Certs(tmp_path, "one")


@pytest.fixture
def other(tmp_path: Path) -> Certs:
    return Certs(tmp_path, "other")


@pytest.fixture
async def https() -> AsyncIterator[Any]:
    """Client sessions with a given TLS context, closed at the end."""
    sessions: list[aiohttp.ClientSession] = []

    def make(ctx: ssl.SSLContext | bool) -> aiohttp.ClientSession:
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        await s.close()


def with_listener(s: Settings, tls: ListenerTLS) -> Settings:
    s.listen = Listen(host="127.0.0.1", port=0, tls=tls)
    return s


async def test_a_stream_goes_through_tls_on_both_sides(fakes, proxy, https, certs) -> None:
    a = await fakes(name="a", ssl_context=certs.rank_context(client_cert=True))
    assert a.url.startswith("https://")
    upstream = {"ca_file": str(certs.ca_file), "cert_file": str(certs.client_file)}
    s = with_listener(settings_for([a], upstream_tls=upstream),
                      ListenerTLS(cert_file=certs.server_file))  # fmt: skip
    p = await proxy(s)  # polled over TLS with the client certificate: routable
    assert p.url.startswith("https://")
    chunks, _, done = await read_stream(https(certs.client_context()), p.url,
                                        "/v1/completions", BODY)  # fmt: skip
    assert done and finishes(chunks) == ["length"] and len(text_of(chunks)) > 0
    assert len(a.received) == 1


async def test_plain_http_to_the_tls_listener_gets_no_answer(fakes, proxy, http, certs) -> None:
    a = await fakes(name="a")
    p = await proxy(with_listener(settings_for([a]), ListenerTLS(cert_file=certs.server_file)))
    plain = p.url.replace("https://", "http://")
    with pytest.raises(aiohttp.ClientError):
        await http.post(plain + "/v1/completions", json=BODY)
    assert a.received == []


async def test_a_connection_that_never_completes_its_handshake_is_closed(
    fakes, proxy, certs
) -> None:
    a = await fakes(name="a")
    s = with_listener(settings_for([a], limits={"header_timeout_s": 0.5}),
                      ListenerTLS(cert_file=certs.server_file))  # fmt: skip
    p = await proxy(s)
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    writer.write(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not held for 60 s
    assert time.monotonic() - started < 2.5
    writer.close()


async def test_workers_share_the_tls_listener(fakes, https, certs, tmp_path: Path) -> None:
    a = await fakes(name="a")
    port = free_port()
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port,
                   "tls": {"cert_file": str(certs.server_file)}},
        "groups": [{"name": "g", "ranks": [{"name": "a", "url": a.url}]}],
        "timeouts": {"poll_interval_s": 0.05}, "log_level": "WARNING",
        "shutdown": {"ready_delay_s": 0, "grace_s": 1}, "logging": {"access_log": False},
    }))  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--workers", "2"
    )
    client = https(certs.client_context())
    url = f"https://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with client.get(url + "/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.1)
        for _ in range(4):  # new connections: whichever worker accepts, it speaks TLS
            headers = {"Connection": "close"}
            async with client.post(url + "/v1/completions", json=BODY, headers=headers) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
        assert len(a.received) == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 10)


async def test_listener_with_client_ca_needs_a_client_certificate(
    fakes, proxy, https, certs
) -> None:
    a = await fakes(name="a")
    tls = ListenerTLS(cert_file=certs.server_file, client_ca_file=certs.ca_file)
    p = await proxy(with_listener(settings_for([a]), tls))
    with pytest.raises(aiohttp.ClientError):
        await https(certs.client_context()).get(p.url + "/health")
    async with https(certs.client_context(with_cert=True)).get(p.url + "/health") as r:
        assert r.status == 200


@pytest.mark.parametrize("case", ["wrong_ca", "system_store", "no_client_cert"])
async def test_a_rank_that_fails_verification_gets_no_request(
    fakes, proxy, http, certs, other, case: str
) -> None:
    a = await fakes(name="a", ssl_context=certs.rank_context(client_cert=case == "no_client_cert"))
    upstream = {
        "wrong_ca": {"ca_file": str(other.ca_file), "cert_file": str(other.client_file)},
        "system_store": {},
        "no_client_cert": {"ca_file": str(certs.ca_file)},
    }[case]
    p = await proxy(settings_for([a], upstream_tls=upstream, timeouts={"queue_s": 0.2}),
                    wait_routable=False)  # fmt: skip
    await asyncio.sleep(0.3)  # several polls
    assert not p.app[TABLE].any_routable()
    async with http.post(p.url + "/v1/completions", json=BODY) as r:
        assert r.status == 503
    assert a.log == []  # not one HTTP request got through the handshake


async def test_verify_false_encrypts_without_checking(fakes, proxy, http, certs) -> None:
    a = await fakes(name="a", ssl_context=certs.rank_context(client_cert=False))
    p = await proxy(settings_for([a], upstream_tls={"verify": False}))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", BODY)
    assert done and finishes(chunks) == ["length"]


GOOD = """
groups: [{name: g, ranks: [{name: r0, url: "https://127.0.0.1:9"}]}]
"""


def bad_configs(certs: Certs, tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (extra YAML, what the error names)."""
    junk = tmp / "junk.pem"
    junk.write_text("not a certificate\n")
    key_only = tmp / "key.pem"
    certs.client.private_key_pem.write_to_path(str(key_only))
    return {
        "missing cert": ("listen: {tls: {cert_file: /nonexistent.pem}}",
                         "cert_file /nonexistent.pem does not exist"),
        "cert not a cert": (f"listen: {{tls: {{cert_file: {junk}}}}}", "cannot load cert_file"),
        "key of another cert": (
            f"listen: {{tls: {{cert_file: {certs.server_file}, key_file: {key_only}}}}}",
            "cannot load cert_file"),
        "missing client ca": (
            f"listen: {{tls: {{cert_file: {certs.server_file}, client_ca_file: /no.pem}}}}",
            "client_ca_file /no.pem does not exist"),
        "key without cert": (f"upstream_tls: {{key_file: {key_only}}}", "key_file needs cert_file"),
        "ca not a ca": (f"upstream_tls: {{ca_file: {junk}}}", "cannot load ca_file"),
        "ca without verify": (f"upstream_tls: {{ca_file: {certs.ca_file}, verify: false}}",
                              "cannot go with verify: false"),
    }  # fmt: skip


def test_tls_config_errors_name_the_file_and_exit_2(
    tmp_path: Path, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, (extra, says) in bad_configs(certs, tmp_path).items():
        path = tmp_path / "proxy.yaml"
        path.write_text(GOOD + extra + "\n")
        with pytest.raises(ConfigError, match=says):
            load_settings(path)
        assert cli.main(["serve", "--config", str(path)]) == cli.EXIT_CONFIG, name
        assert says in capsys.readouterr().err, name


def test_good_tls_config_loads(tmp_path: Path, certs: Certs) -> None:
    path = tmp_path / "proxy.yaml"
    upstream = f"{{ca_file: {certs.ca_file}, cert_file: {certs.client_file}}}"
    listener = f"{{tls: {{cert_file: {certs.server_file}}}}}"
    path.write_text(GOOD + f"listen: {listener}\nupstream_tls: {upstream}\n")
    s = load_settings(path)
    assert s.listen.tls is not None and isinstance(s.upstream_tls.context(), ssl.SSLContext)


async def test_cli_talks_to_a_tls_proxy_with_its_ca(fakes, proxy, certs) -> None:
    a = await fakes(name="a")
    s = with_listener(settings_for([a], admin={"token": "adm"}),
                      ListenerTLS(cert_file=certs.server_file))  # fmt: skip
    p = await proxy(s)

    async def status(*extra: str) -> tuple[int, bytes]:
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "status", "--once", "--url", p.url, "--token", "adm",
            *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "COLUMNS": "120"},
        )  # fmt: skip
        out, err = await cli.communicate()
        assert cli.returncode is not None
        return cli.returncode, out + err

    code, out = await status("--ca-file", str(certs.ca_file))
    assert code == 0 and b"healthy" in out, out
    code, out = await status()  # the system store does not know this CA
    assert code == 1 and b"cannot reach" in out, out


async def test_a_reload_rotates_the_listener_certificate(fakes, https, certs, other,
                                                         tmp_path: Path) -> None:  # fmt: skip
    """SIGHUP or /admin/reload reads the certificate files again: new
    handshakes get the new certificate, with no restart; a broken file is
    refused and the one in use stays."""
    from proxy.server import start

    a = await fakes(name="a")
    served = tmp_path / "served.pem"  # the path the config names, rewritten by "rotation"
    served.write_bytes(certs.server_file.read_bytes())
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0, "tls": {"cert_file": str(served)}},
        "groups": [{"name": "g", "ranks": [{"name": "a", "url": a.url}]}],
        "admin": {"token": "adm"},
    }))  # fmt: skip
    running = await start(load_settings(cfg), cfg)
    auth = {"Authorization": "Bearer adm"}

    async def handshake_ok(trusting: Certs) -> bool:
        try:
            async with https(trusting.client_context()).get(running.url + "/live") as r:
                return r.status == 200
        except aiohttp.ClientConnectorError:
            return False

    try:
        assert await handshake_ok(certs) and not await handshake_ok(other)
        served.write_bytes(other.server_file.read_bytes())
        async with https(certs.client_context()).post(running.url + "/admin/reload",
                                                      headers=auth) as r:  # fmt: skip
            assert r.status == 200 and (await r.json())["listener_tls"] == "reloaded"
        assert await handshake_ok(other) and not await handshake_ok(certs)

        served.write_text("not a certificate\n")
        async with https(other.client_context()).post(running.url + "/admin/reload",
                                                      headers=auth) as r:  # fmt: skip
            body = await r.json()
            assert r.status == 400 and "config not reloaded" in body["error"]["message"]
        assert await handshake_ok(other)  # the certificate in use stays
    finally:
        await running.stop()
