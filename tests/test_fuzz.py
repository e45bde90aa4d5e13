"""Hostile inputs, fuzzed: >= 10,000 raw requests over sockets against the proxy
in front of two fake ranks, while good streams run beside them.

Categories: path encodings (dot segments, %2e, %2f, %5c, backslashes,
absolute form, duplicate slashes, NUL) on every method; field types of every
field the proxy reads; JSON nesting, encodings and invalid text; content
encodings; HTTP parser junk; slow clients and disconnects.

Asserted over the whole run: no 5xx; every error the proxy answers is
OpenAI-shaped JSON; no request the proxy refused reached a rank; nothing
outside the allow-list reached a rank (counted at the fakes); the good
streams are exact. The corpus is seeded, so a failure replays.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.state import SETTINGS
from proxy.target import DEFAULT_FORWARD
from tests.conftest import settings_for
from tests.fakes import FakeRank, detok, next_token, tokenize

SEED = 13
TOTAL = int(os.environ.get("FTPROXY_FUZZ_TOTAL", "10500"))
CONCURRENCY = 32
ALLOWED = {entry.split(" ", 1)[1] for entry in DEFAULT_FORWARD}
KEY = "sk-fuzz"

TRAVERSALS = ["..", "%2e%2e", "%2E%2E", ".%2e", "%2e.", "..%2f", "..%2F", "..%5c", "..%5C",
              "\\..", "%252e%252e", ".", "%2e", "", "..;", "%00", "%2f", "..\\"]  # fmt: skip
TARGETS = ["fault_tolerance/apply", "fault_tolerance/status", "health", "metrics", "load",
           "v1/completions", "tokenize", "unknown", "admin/retry", "v1/models"]  # fmt: skip
PREFIXES = ["/v1/", "/", "/v1/chat/", "/tokenize/", "//", "/v1//"]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
VALUES: list[Any] = ["abc", "", [1], [], {}, {"a": 1}, 5, -1, 0, 1.5, True, False, None,
                     [[]], ["a", 1], "x" * 2000, 10**30, -(10**30), [None], "true",
                     "5"]  # fmt: skip
FIELDS = ["n", "best_of", "stop", "stream", "stream_options", "max_tokens",
          "max_completion_tokens", "min_tokens", "return_token_ids", "logprobs",
          "top_logprobs", "temperature", "prompt", "model", "echo", "suffix",
          "response_format", "tools", "tool_choice", "stop_token_ids",
          "include_stop_str_in_output", "use_beam_search"]  # fmt: skip


@dataclass
class Case:
    rid: str
    data: bytes
    kind: str
    slow: bool = False
    hang_up: bool = False


def _request(method: str, target: str, body: bytes = b"", rid: str = "",
             headers: dict[str, str] | None = None, auth: bool = True) -> bytes:  # fmt: skip
    lines = [
        f"{method} {target} HTTP/1.1",
        "Host: proxy",
        "Connection: close",
        f"X-Request-Id: {rid}",
    ]
    if auth:
        lines.append(f"Authorization: Bearer {KEY}")
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    lines += [f"{k}: {v}" for k, v in hdrs.items()]
    if "Transfer-Encoding" not in hdrs:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _completion(**over: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "fuzz", "max_tokens": 2, **over}


def _chat(**over: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "fuzz"}],
            "max_tokens": 2, **over}  # fmt: skip


def _nest(depth: int, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def corpus(port: int) -> Iterator[Case]:
    rng = random.Random(SEED)
    plain = json.dumps(_completion()).encode()
    encoded = [
        ("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain)),
        ("gzip", b"not gzip at all"), ("deflate", b"\x00\x01\x02"), ("compress", plain),
        ("gzip, gzip", gzip.compress(gzip.compress(plain))), ("x-gzip", plain),
        ("identity", plain), ("gzip", gzip.compress(b"{" * 100_000)),
        ("gzip", gzip.compress(b" " * 20_000_000)),  # a bomb: 20 MB from ~20 KB
    ]  # fmt: skip
    for i in range(TOTAL):
        rid = f"fz-{i}"
        kind = rng.choice(["path", "path", "field", "field", "field", "nest", "text",
                           "encoding", "junk", "good", "slow", "hangup"])  # fmt: skip
        if kind == "path":
            parts = [rng.choice(TRAVERSALS) for _ in range(rng.randint(1, 3))]
            target = rng.choice(PREFIXES) + "/".join(parts) + "/" + rng.choice(TARGETS)
            if rng.random() < 0.15:
                target = f"http://127.0.0.1:{port}" + target
            if rng.random() < 0.1:
                target = target.replace("/", "\\", 1)
            body = json.dumps({"instruction": "retry", **_completion()}).encode()
            yield Case(rid, _request(rng.choice(METHODS), target, body, rid), kind)
        elif kind == "field":
            chat = rng.random() < 0.4
            base = _chat() if chat else _completion()
            for _ in range(rng.randint(1, 3)):
                base[rng.choice([*FIELDS, "messages"] if chat else FIELDS)] = rng.choice(VALUES)
            if rng.random() < 0.3:
                base["stream_options"] = {"include_usage": rng.choice(VALUES)}
            if base.get("max_tokens") not in (None, 0, 1, 2, -1):  # keep fakes' answers short
                base["max_tokens"] = rng.choice([1, 2, "x", [2], -1])
            base.pop("n", None) if base.get("n") == 10**30 else None
            if base.get("best_of") == 10**30:
                base.pop("best_of")
            path = "/v1/chat/completions" if chat else "/v1/completions"
            yield Case(rid, _request("POST", path, json.dumps(base).encode(), rid), kind)
        elif kind == "nest":
            depth = rng.choice([10, 62, 63, 64, 65, 100, 1000, 10_000, 50_000])
            inner = _nest(depth, rng)
            body = b'{"model":"m","prompt":' + inner + b',"max_tokens":1}'
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize",
                               "/admin/retry", "/admin/ranks/a"])  # fmt: skip
            method = "PATCH" if path == "/admin/ranks/a" else "POST"
            headers = {"Authorization": "Bearer adm"} if path.startswith("/admin") else None
            yield Case(rid, _request(method, path, body, rid, headers), kind)
        elif kind == "text":
            body = rng.choice([
                b'{"prompt":"\xed\xa0\x80","max_tokens":1}', b'{"prompt":"\\ud800","max_tokens":1}',
                b'\xef\xbb\xbf{"prompt":"x","max_tokens":1}', b'{"prompt":"x","max_tokens":NaN}',
                b'{"prompt":"x","temperature":Infinity}', b'{"prompt":"\xff\xfe"}', b"[]", b"1",
                b"", b"{", b'{"prompt":"x"}garbage', b'{"prompt":"x","max_tokens":1e999}',
                b"null", b'"string"',
            ])  # fmt: skip
            ctype = rng.choice(["application/json", "text/plain",
                                "application/x-www-form-urlencoded",
                                "application/json; charset=latin-1", ""])  # fmt: skip
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
            yield Case(rid, _request("POST", path, body, rid, {"Content-Type": ctype}), kind)
        elif kind == "encoding":
            enc, body = rng.choice(encoded)
            yield Case(rid, _request("POST", "/v1/completions", body, rid,
                                     {"Content-Encoding": enc}), kind)  # fmt: skip
        elif kind == "junk":
            yield Case(rid, rng.choice(_junk(rid)), kind)
        elif kind == "good":
            body = json.dumps(_completion(max_tokens=rng.randint(1, 3))).encode()
            path = rng.choice(["/v1/completions", "/tokenize", "/v1/embeddings"])
            yield Case(rid, _request("POST", path, body, rid, auth=rng.random() < 0.9), kind)
        elif kind == "slow":
            body = json.dumps(_completion()).encode()
            yield Case(rid, _request("POST", "/v1/completions", body, rid), kind, slow=True)
        else:
            body = json.dumps(_completion(stream=True, max_tokens=50)).encode()
            yield Case(rid, _request("POST", "/v1/completions", body, rid), kind, hang_up=True)


def _junk(rid: str) -> list[bytes]:
    long = "x" * 9000
    return [
        f"GET /v1/{long} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        f"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: {long}\r\n\r\n".encode(),
        b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(130)) + b"\r\n",
        b"GET / HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
        b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(64)),
        b"POST /v1/completions HTTP/1.1\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
        f"POST /v1/completions HTTP/1.1\r\nX-Request-Id: {rid}\r\nContent-Type: application/json"
        "\r\nContent-Length: 999999999999\r\n\r\n{}".encode(),
        f"GET /v1/completions HTTP/1.1\r\nX-Request-Id: {'z' * 500}\r\n\r\n".encode(),
        b"\r\n\r\n\r\n",
    ]


@dataclass
class Outcome:
    status: int
    ctype: str
    body: bytes


async def _exchange(port: int, case: Case) -> Outcome | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if case.slow:  # dribble the head; the proxy must not wait forever
            for i in range(0, len(case.data), 64):
                writer.write(case.data[i : i + 64])
                await asyncio.sleep(0.05)
        else:
            writer.write(case.data)
        await writer.drain()
        if case.hang_up:
            await reader.read(200)  # the stream has begun: leave mid-way
            return None
        raw = await asyncio.wait_for(reader.read(), 10)
    except (ConnectionError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
    if not raw:
        return None  # closed without an answer (TLS garbage and the like)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Outcome(int(lines[0].split(" ")[1]), headers.get("content-type", ""), body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def _good_text(prompt: str, n: int) -> str:
    ctx = tokenize(prompt)
    out = []
    for _ in range(n):
        ctx.append(next_token(ctx))
        out.append(ctx[-1])
    return detok(out)


async def _good_streams(url: str, stop: asyncio.Event) -> int:
    """Exact streams beside the fuzz; returns how many were checked."""
    checked = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        while not stop.is_set():
            prompt = f"good {checked}"
            body = {"model": "fake-model", "prompt": prompt, "max_tokens": 20, "stream": True}
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                raw = (await r.read()).decode()
            text, done = "", False
            for ev in raw.split("\n\n"):
                if ev == "data: [DONE]":
                    done = True
                elif ev.startswith("data: "):
                    text += json.loads(ev[6:])["choices"][0]["text"]
            assert done and text == _good_text(prompt, 20), (prompt, text)
            checked += 1
    return checked


def _assert_openai_error(out: Outcome, case: Case) -> None:
    if case.data.startswith(b"HEAD "):
        return  # HEAD answers carry no body
    assert out.ctype.startswith("application/json"), (case.kind, out.status, out.body[:200])
    try:
        err = json.loads(out.body)["error"]
    except ValueError:
        raise AssertionError(
            (case.kind, case.data[:300], out.status, out.ctype, out.body[:300])
        ) from None
    assert {"message", "type", "code"} <= set(err), (case.kind, out.body[:200])


async def test_fuzz(fakes, proxy) -> None:
    ranks: list[FakeRank] = [await fakes(name="a"), await fakes(name="b")]
    limits = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "max_body_bytes": 1 << 20}
    p = await proxy(settings_for(ranks, api_keys=[KEY], admin={"token": "adm"}, limits=limits))
    cases = list(corpus(p.port))
    assert len(cases) == TOTAL
    outcomes: dict[str, tuple[Case, Outcome | None]] = {}
    queue: asyncio.Queue[Case] = asyncio.Queue()
    for case in cases:
        queue.put_nowait(case)

    took: Counter[str] = Counter()

    async def worker() -> None:
        while not queue.empty():
            case = queue.get_nowait()
            t0 = time.monotonic()
            outcomes[case.rid] = (case, await _exchange(p.port, case))
            took[case.kind] += time.monotonic() - t0

    stop = asyncio.Event()
    good = asyncio.create_task(_good_streams(p.url, stop))
    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    elapsed = time.monotonic() - started
    stop.set()
    streams_checked = await good

    statuses: Counter[int] = Counter()
    refused: set[str] = set()
    for rid, (case, out) in outcomes.items():
        if out is None:
            continue
        statuses[out.status] += 1
        assert out.status < 500, (case.kind, case.data[:300], out.status, out.body[:300])
        if out.status >= 400:
            _assert_openai_error(out, case)
            # The proxy's own error codes are strings; vLLM's (and the fakes') are ints.
            if isinstance(json.loads(out.body or b"{}").get("error", {}).get("code"), str):
                refused.add(rid)
    # Bounded work: no client request cost more upstream requests than its budget.
    sent = Counter(rid for rank in ranks for _, _, rid in rank.log if rid and rid.startswith("fz-"))
    budget = 1 + p.app[SETTINGS].hold.max_continuations
    assert max(sent.values()) <= budget, sent.most_common(3)
    print(f"\nfuzz: upstream requests per forwarded request: {Counter(sent.values())}")
    # Nothing refused reached a rank; nothing outside the allow-list did.
    for rank in ranks:
        for method, target, rid in rank.log:
            if rid is None or not rid.startswith("fz-"):
                continue  # the proxy's own polls, the good streams
            case = outcomes[rid][0]
            assert rid not in refused, (rid, method, target, case.kind)
            assert target in ALLOWED and method == "POST", (rid, method, target)
        assert not rank.applies
    assert streams_checked >= 5
    print(f"\nfuzz: {len(cases)} requests in {elapsed:.1f}s, {streams_checked} good streams, "
          f"statuses {dict(sorted(statuses.items()))}, seconds by kind {dict(took)}")  # fmt: skip
