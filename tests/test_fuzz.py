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

The hostile-rank half turns it round: good requests, and ranks that answer a
seeded share of them with trailers, bad status codes, 5xx, odd header bytes,
bodies over the limit, cut bodies and resets (tests.hostile_rank), through a
proxy with the fast lane and one without. Each answer is tagged with its
request: asserted that every client gets exactly its answer or a 502, none
carries another's bytes or a trailer as a header, the good streams beside
stay exact, no rank is marked down, and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from bench.validate import Ask, check_stream, check_whole, sse_payloads
from proxy.core.forward import DEFAULT_FORWARD
from proxy.core.settings import Settings
from proxy.ingress.state import LIMIT, SETTINGS, TABLE
from tests.conftest import settings_for
from tests.fakes import FakeRank, detok, next_token, tokenize
from tests.hostile_rank import MISBEHAVIOURS, HostileRank, Plan, choice

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


# -- the hostile-rank half ------------------------------------------------------------
# Clients send good requests; the ranks answer a seeded share of them badly
# (tests.hostile_rank). Every answer is tagged with its request.
HOSTILE_TOTAL = int(os.environ.get("FTPROXY_FUZZ_HOSTILE_TOTAL", "4000"))
HOSTILE_SHARE = 0.35
UPSTREAM_LIMIT = 1 << 20  # limits.max_upstream_body_bytes; a flood goes on to 16 MiB
# What the proxy's memory may grow by over the run; the floods offer hundreds of MiB.
RSS_GROWTH = 96 << 20
_TAG = re.compile(rb"(?:fh|good)-[0-9-]+")
_NEVER = (b"x-leak", b"set-cookie", b"content-encoding")


@dataclass
class Sent:
    """One client request of the hostile half."""

    rid: str
    path: str
    stream: bool
    tokens: int
    lane: bool  # to the proxy with the fast lane, or to the one without

    def data(self) -> bytes:
        body: dict[str, Any] = {"model": "m", "prompt": "x", "max_tokens": self.tokens}
        if self.path == "/v1/completions":
            body["stream"] = self.stream
        return _request("POST", self.path, json.dumps(body).encode(), self.rid, auth=False)

    def expected(self) -> str:
        """``good`` (the exact answer) or ``502``, from what the rank does first."""
        what = choice(SEED, HOSTILE_SHARE, self.rid)
        if what in ("declared", "flood"):
            return "502"  # over the limit: never passed on, never read on
        if what in ("cut", "reset") and self.path == "/tokenize":
            return "502"  # lost: nothing to start again from
        # Good: the answer itself, the other rank's (a bad status, a 5xx), or
        # one generated again from the prompt (a completion lost before its end).
        return "good"


def hostile_corpus() -> list[Sent]:
    rng = random.Random(SEED)
    out = []
    for i in range(HOSTILE_TOTAL):
        path = rng.choice(["/v1/completions", "/v1/completions", "/tokenize"])
        stream = path == "/v1/completions" and rng.random() < 0.5
        out.append(Sent(f"fh-{i}", path, stream, rng.randint(1, 4), rng.random() < 0.5))
    return out


@dataclass
class RawAnswer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    raw: bytes


async def _raw_exchange(port: int, data: bytes) -> RawAnswer:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = [(k.lower(), v) for k, _, v in (line.partition(b": ") for line in lines[1:])]
    if (b"transfer-encoding", b"chunked") in headers:
        body = _dechunk(body)
    return RawAnswer(int(lines[0].split(b" ")[1]), headers, body, raw)


def _check_tags(ask: Sent, got: RawAnswer) -> None:
    """No bytes of another request's answer, no trailer as a header."""
    names = {k for k, _ in got.headers}
    assert names.isdisjoint(_NEVER), (ask, got.raw[:400])
    tags = [v for k, v in got.headers if k == b"x-tag"]
    assert tags in ([], [ask.rid.encode()]), (ask, tags)
    others = set(_TAG.findall(got.raw)) - {ask.rid.encode()}
    assert not others, (ask, others, got.raw[:400])


def _check_good(ask: Sent, got: RawAnswer) -> None:
    assert got.status == 200, (ask, got.raw[:400])
    if ask.path == "/tokenize":
        assert orjson.loads(got.body) == {"tag": ask.rid, "count": 3, "tokens": [1, 2, 3]}, ask
    elif ask.stream:
        payloads = sse_payloads(got.body)
        check_stream(Ask(ask.tokens), payloads)
        ids = {orjson.loads(p)["id"] for p in payloads[:-1]}
        assert ids == {f"cmpl-{ask.rid}"}, (ask, ids)
    else:
        check_whole(Ask(ask.tokens), got.status, got.body)
        assert orjson.loads(got.body)["id"] == f"cmpl-{ask.rid}", ask


def _check(ask: Sent, got: RawAnswer) -> str:
    """The answer is what the rank's misbehaviour calls for; returns its name."""
    what = choice(SEED, HOSTILE_SHARE, ask.rid)
    _check_tags(ask, got)
    if ask.expected() == "502":
        assert got.status == 502, (ask, what, got.raw[:400])
        assert orjson.loads(got.body)["error"]["code"] == "upstream_failed", (ask, what)
        return what
    _check_good(ask, got)
    if what == "odd_header":  # U+FFFD for the byte that is not UTF-8, on both paths
        assert [v for k, v in got.headers if k == b"x-odd"] == [b"a\xef\xbf\xbdb\xc3\xa9"], ask
    return what


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _hostile_good_streams(ports: list[int], stop: asyncio.Event, name: str) -> int:
    """Exact streams beside the hostile answers, on the same pooled connections."""
    checked = 0
    while not stop.is_set():
        ask = Sent(f"good-{name}-{checked}", "/v1/completions", True, 6, checked % 2 == 0)
        got = await _raw_exchange(ports[ask.lane], ask.data())
        _check_tags(ask, got)
        _check_good(ask, got)
        checked += 1
    return checked


async def test_fuzz_hostile_ranks(proxy) -> None:
    plan = Plan(SEED, HOSTILE_SHARE)
    servers = [await HostileRank.serve(plan) for _ in range(2)]
    groups = [
        {
            "name": f"g{i}",
            "ranks": [
                {"name": f"r{i}", "url": f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}"}
            ],
        }
        for i, s in enumerate(servers)
    ]
    running = []
    for lane in (False, True):
        settings = Settings(
            listen={"host": "127.0.0.1", "port": 0, "fast_lane": lane},
            groups=groups,
            timeouts={"poll_interval_s": 0.05, "queue_s": 2.0},
            limits={"max_upstream_body_bytes": UPSTREAM_LIMIT},
        )
        running.append(await proxy(settings))
    ports = [r.port for r in running]
    asks = hostile_corpus()
    queue: asyncio.Queue[Sent] = asyncio.Queue()
    for ask in asks:
        queue.put_nowait(ask)
    outcomes: Counter[str] = Counter()
    peak = baseline = _rss()

    async def worker() -> None:
        while not queue.empty():
            ask = queue.get_nowait()
            got = await _raw_exchange(ports[ask.lane], ask.data())
            outcomes[f"{_check(ask, got)}->{got.status}"] += 1

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _rss())
            await asyncio.sleep(0.02)

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample())
    good = [asyncio.create_task(_hostile_good_streams(ports, stop, str(i))) for i in range(2)]
    started = time.monotonic()
    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        elapsed = time.monotonic() - started
        stop.set()
        streams = sum(await asyncio.gather(*good))
        sampler.cancel()
        for s in servers:
            s.close()
        await asyncio.gather(sampler, return_exceptions=True)
    assert set(MISBEHAVIOURS) <= set(plan.done), plan.done  # each one was carried out
    assert streams >= 10
    # A flood is cut short: the proxy stops reading at its limit and closes.
    assert plan.floods and max(plan.floods) < plan.flood_bytes, plan.floods
    assert peak - baseline < RSS_GROWTH, f"memory grew by {(peak - baseline) >> 20} MiB"
    for r in running:  # a bad answer is no rank down
        assert all(rank.routable for rank in r.app[TABLE]), [rank.name for rank in r.app[TABLE]]
        assert r.app[LIMIT].in_flight == 0
    # Sent again once at most: to the other rank, or from the prompt; never after a good answer.
    assert max(plan.attempts.values()) == 2, plan.attempts.most_common(3)
    print(
        f"\nfuzz, hostile ranks: {len(asks)} requests in {elapsed:.1f}s, {streams} good "
        f"streams beside, outcomes {dict(sorted(outcomes.items()))}, floods offered "
        f"{sum(plan.floods) >> 20} MiB, memory +{(peak - baseline) >> 20} MiB"
    )
