"""The routing surface: no spelling of a path reaches a rank's control endpoints."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.core.errors import InvalidTarget
from proxy.core.forward import parse_forward
from proxy.core.settings import Settings
from proxy.core.target import check_target, upstream_url
from proxy.ingress.pipeline import _NORMAL_LEN, _NORMAL_MAX, PIPELINE
from tests.conftest import settings_for

# Each would reach /fault_tolerance/*, /health or another path by normalization.
HOSTILE = [
    "/v1/%2e%2e/fault_tolerance/apply",
    "/v1/%2E%2E/fault_tolerance/apply",
    "/v1/../fault_tolerance/apply",
    "/v1/.%2e/fault_tolerance/apply",
    "/v1/%2e./fault_tolerance/apply",
    "/v1/./../fault_tolerance/status",
    "/v1/..%2ffault_tolerance/apply",
    "/v1/..%2Ffault_tolerance/apply",
    "/v1/%2f../fault_tolerance/apply",
    "/v1/..%5cfault_tolerance/apply",
    "/v1/..\\fault_tolerance/apply",
    "/v1\\..\\health",
    "/v1/%252e%252e/health",
    "/v1//../health",
    "//health",
    "/v1/completions/..",
    "/v1/completions/.",
    "/v1/completions/",
    "/v1//completions",
    "/v1/completions%00",
    "/v1/completions%2",
    "/v1/completions%zz",
    "/v1/completions?x=%00",
    "/v1/completions#frag",
    "http://127.0.0.1/fault_tolerance/apply",
    "http://127.0.0.1/v1/completions",
    "*",
    "127.0.0.1:80",
]

PARSER_REJECTS = {"*", "127.0.0.1:80"}


@pytest.mark.parametrize("target", HOSTILE)
def test_hostile_targets_are_refused(target: str) -> None:
    with pytest.raises(InvalidTarget):
        check_target(target)


@pytest.mark.parametrize(
    "target", ["/v1/completions", "/v1/chat/completions?x=1&y=%20", "/admin/ranks/r%20a", "/"]
)
def test_normal_targets_pass(target: str) -> None:
    assert check_target(target) == target.partition("?")[0]


def test_upstream_url_is_base_plus_allowed_path() -> None:
    assert str(upstream_url("http://h:8000", "/v1/completions")) == "http://h:8000/v1/completions"
    assert str(upstream_url("http://h:8000/pre", "/tokenize")) == "http://h:8000/pre/tokenize"


@pytest.mark.parametrize(
    "entry",
    ["POST /fault_tolerance/apply", "GET /health", "GET /metrics", "POST /v1/../health",
     "POST /v1//x", "POST v1/x", "TRACE /v1/x", "GET /v1/models", "POST /v1/{tail}",
     "POST /admin/retry", "POST /collective_rpc"],
)  # fmt: skip
def test_config_refuses_unsafe_forward_entries(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_forward(entry)
    with pytest.raises(ValidationError):
        Settings(groups=[{"name": "g", "ranks": [{"name": "r", "url": "http://h:1"}]}],
                 routing={"forward": [entry]})  # fmt: skip


@pytest.mark.parametrize("url", ["http://h:1?x=1", "http://u:p@h:1", "http://", "http://h:1#f"])
def test_config_refuses_odd_rank_urls(url: str) -> None:
    with pytest.raises(ValidationError):
        Settings(groups=[{"name": "g", "ranks": [{"name": "r", "url": url}]}])


async def _raw(
    port: int, target: str, body: bytes = b"{}", method: str = "POST"
) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


async def test_no_encoding_of_a_path_reaches_a_rank(fakes, proxy) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], api_keys=["sk-test"]))
    extra = ["/fault_tolerance/apply", "/health/x", "/metrics/", "/v1/../../health",
             "/v1/unknown", "/v1/fault_tolerance/apply", "/load", "/tokenize/x"]  # fmt: skip
    for target in HOSTILE + extra:
        for method in ("POST", "GET"):
            status, body = await _raw(p.port, target, b'{"instruction":"retry"}', method)
            assert status in (400, 401, 404, 405), (target, status, body)
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}, (target, body)
            if target in PARSER_REJECTS:  # refused by aiohttp's parser (proxy.listener)
                assert (status, err["code"]) == (400, "bad_http_request"), target
            elif target.startswith("http://"):  # the absolute form: read as its path (RFC 9112)
                path = target.removeprefix("http://127.0.0.1")
                as_path = await _raw(p.port, path, b'{"instruction":"retry"}', method)
                assert (status, body) == as_path, target
            elif target in HOSTILE:  # refused before routing or auth
                assert (status, err["code"]) == (400, "invalid_request_target"), target
    for own in ("/health", "/metrics"):  # the proxy's own, answered without a rank
        assert (await _raw(p.port, own, method="GET"))[0] == 200
    assert a.forwarded() == []
    assert not a.applies


async def test_allow_listed_paths_are_forwarded_unknown_ones_are_not(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    for path in ("/tokenize", "/detokenize", "/v1/embeddings", "/v1/score", "/v1/rerank"):
        async with http.post(p.url + path + "?q=1", json={"prompt": "x", "tokens": [1]}) as r:
            assert r.status == 200, path
            if path == "/detokenize":  # answered as vLLM does, not echoed
                assert (await r.json()) == {"prompt": "t1 "}
            else:
                assert (await r.json())["path"] == path  # the client's query is not forwarded
    async with http.get(p.url + "/v1/completions") as r:
        assert r.status == 405
        got: Any = await r.json()
        assert got["error"]["code"] == "method_not_allowed"
        assert r.headers["Allow"] == "POST"
    async with http.post(p.url + "/v1/unknown", json={}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "not_found"
    paths = [t for _, t in a.forwarded()]
    assert paths == ["/tokenize", "/detokenize", "/v1/embeddings", "/v1/score", "/v1/rerank"]


async def test_forward_list_is_configurable(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], routing={"forward": ["POST /v1/completions"]}))
    async with http.post(p.url + "/tokenize", json={"prompt": "x"}) as r:
        assert r.status == 404
    assert a.forwarded() == []


async def test_targets_found_normal_are_remembered_within_bounds(fakes, proxy) -> None:
    # The pipeline does not check a target it found in normal form again;
    # what it keeps stays within its bounds, and past them every target is
    # still checked.
    p = await proxy(settings_for([await fakes(name="a")]))
    normal: set[str] = p.app[PIPELINE]._normal
    long = "/health?" + "x" * _NORMAL_LEN
    for target in ("/health", long):
        assert (await _raw(p.port, target, method="GET"))[0] == 200
    assert "/health" in normal
    assert long not in normal
    normal.update(f"/filler/{i}" for i in range(_NORMAL_MAX - len(normal)))
    assert (await _raw(p.port, "/health?past=bound", method="GET"))[0] == 200
    assert "/health?past=bound" not in normal
    assert len(normal) == _NORMAL_MAX
    assert (await _raw(p.port, "/v1/../health", method="GET"))[0] == 400
