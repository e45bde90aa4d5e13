"""The access log: one json line per client request, however it ended."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.control.feed import PushFeed
from proxy.control.pushwire import FeedMessage
from proxy.control.ranks import RankTable
from proxy.core.settings import Settings, Timeouts
from proxy.ingress.state import ACCESS_LOG, METRICS
from proxy.telemetry import accesslog, logformat
from proxy.telemetry.accesslog import AccessLog, AccessRecord, End
from proxy.telemetry.metrics import Metrics
from tests.conftest import capture_access_log as capture
from tests.conftest import replicas, settings_for

HOLD = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0}
JSON_LOGS = {"access_log": True, "format": "json"}


async def lines(out: io.StringIO, n: int) -> list[dict[str, Any]]:
    for _ in range(200):
        got = [json.loads(line) for line in out.getvalue().splitlines()]
        if len(got) >= n:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"expected {n} access lines, got: {out.getvalue()!r}")


async def test_four_requests_four_lines(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=60)
    b = await fakes(name="b", token_delay_s=0.002)
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD, logging=JSON_LOGS))
    out = capture(p)
    headers = {"Authorization": "Bearer not-logged", "X-Request-Id": "held-1"}
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 30, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()
    whole = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
    async with http.post(p.url + "/v1/completions", json=whole,
                         headers={"X-Request-Id": "whole-1"}) as r:  # fmt: skip
        assert r.status == 200
    async with http.post(p.url + "/v1/completions", data=b"{not json",
                         headers={"Content-Type": "application/json",
                                  "X-Request-Id": "bad-1"}) as r:  # fmt: skip
        assert r.status == 400
    slow = {"model": "fake-model", "prompt": "bye", "max_tokens": 500, "stream": True}
    b.token_delay_s = 0.05
    async with aiohttp.ClientSession() as gone:
        resp = await gone.post(p.url + "/v1/completions", json=slow,
                               headers={"X-Request-Id": "left-1"})  # fmt: skip
        await resp.content.readline()
        resp.close()
    held, whole_line, bad, left = await lines(out, 4)

    assert "not-logged" not in out.getvalue() and "hello" not in out.getvalue()
    keys = list(held)
    assert all(list(line) == keys for line in (whole_line, bad, left))  # stable keys
    assert held["request_id"] == "held-1" and held["logger"] == "ftproxy.access"
    assert held["status"] == 200 and held["end"] == End.FINISHED
    assert held["ranks"] == ["a", "b"] and held["group"] == "g-b"  # where it ended
    assert held["holds"] == 1 and held["continuations"] == 1 and held["hold_s"] >= 0
    assert held["completion_tokens"] == 30 and held["prompt_tokens"] == 5
    assert held["model"] == "fake-model" and held["method"] == "POST"
    assert 0 < held["ttfb_s"] <= held["duration_s"]

    assert whole_line["request_id"] == "whole-1" and whole_line["ranks"] == ["b"]
    assert whole_line["end"] == End.FINISHED and whole_line["completion_tokens"] == 5
    assert whole_line["holds"] == 0 and whole_line["continuations"] == 0

    assert bad["request_id"] == "bad-1" and bad["status"] == 400
    assert bad["end"] == End.REFUSED and bad["ranks"] == [] and bad["model"] is None

    assert left["request_id"] == "left-1" and left["end"] == End.CLIENT_LEFT
    assert left["status"] == 499 and left["ranks"] == ["b"]
    assert left["completion_tokens"] is not None and left["completion_tokens"] < 500

    metrics = p.app[METRICS]
    assert metrics.refusals.labels("invalid_json")._value.get() == 1
    assert metrics.client_disconnects._value.get() == 1
    assert metrics.continuations._sum.get() == 1


async def test_a_continued_whole_answer_counts_its_tokens(fakes, proxy, http) -> None:
    """A whole answer the rank aborted is completed by a continuation: its line
    counts the continued answer's tokens (the book made for the continuation),
    and a whole answer the rank never reached counts none generated."""
    a = await fakes(name="a", token_delay_s=0.002, fault_after=7, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD, logging=JSON_LOGS))
    out = capture(p)
    whole = {"model": "fake-model", "prompt": "hello", "max_tokens": 30}
    async with http.post(p.url + "/v1/completions", json=whole) as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["usage"]["completion_tokens"] == 30
    (line,) = await lines(out, 1)
    assert line["continuations"] == 1 and line["end"] == End.FINISHED
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5, 30)


async def test_access_log_off_writes_nothing(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], logging={"access_log": False}))
    assert p.app[ACCESS_LOG] is None
    async with http.post(p.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 200


async def test_no_rank_is_its_own_end(fakes, proxy, http) -> None:
    a = await fakes(name="a", status="unhealthy")
    p = await proxy(settings_for([a], timeouts={"queue_s": 0.1}, logging=JSON_LOGS),
                    wait_routable=False)  # fmt: skip
    out = capture(p)
    async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 503
    (line,) = await lines(out, 1)
    assert line["end"] == End.NO_RANK and line["queue_s"] >= 0.09
    assert p.app[METRICS].queue_wait._sum.get() >= 0.09


def test_text_line_is_one_readable_line() -> None:
    out = io.StringIO()
    rec = AccessRecord("r-1", "POST", "/v1/x\nINJECTED")
    rec.model, rec.end = "m\nx", End.FINISHED
    rec.served_by("r0", "dp-a")
    AccessLog("text", out).write(rec)
    line = out.getvalue()
    assert line.count("\n") == 1 and "[r-1] POST" in line and "ranks=r0" in line
    assert "end=finished" in line


def test_json_event_logs_carry_the_request_id() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logformat.JsonFormatter())
    log = logging.getLogger("ftproxy.test")
    log.addHandler(handler)
    try:
        token = accesslog.REQUEST_ID.set("rid-7")  # access log off: the id alone
        log.warning("inside %s", "a request")
        accesslog.REQUEST_ID.reset(token)
        token = accesslog.CURRENT.set(AccessRecord("rid-8", "GET", "/"))  # on: its record
        log.warning("logged")
        accesslog.CURRENT.reset(token)
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    inside, logged, outside = (json.loads(x) for x in stream.getvalue().splitlines())
    assert inside == {"ts": inside["ts"], "level": "WARNING", "logger": "ftproxy.test",
                      "msg": "inside a request", "request_id": "rid-7"}  # fmt: skip
    assert logged["request_id"] == "rid-8"
    assert "request_id" not in outside and outside["msg"] == "outside"


def test_event_logs_configured_again_replace_the_earlier_handler() -> None:
    # In a process of its own: configuring replaces the root logger's handlers.
    code = (
        "import logging; from proxy.telemetry import logformat\n"
        "logging.getLogger().addHandler(logging.StreamHandler())\n"
        "logformat.configure('text', 'debug'); logformat.configure('json', 'info')\n"
        "logging.getLogger('x').debug('hidden'); logging.getLogger('x').info('shown')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True)
    (line,) = run.stderr.decode().splitlines()
    got = json.loads(line)
    assert got.pop("ts") and got == {"level": "INFO", "logger": "x", "msg": "shown"}


def test_feed_heartbeat_age_per_rank() -> None:
    settings = Settings(groups=[{"name": "g", "ranks": [
        {"name": "fed", "url": "http://127.0.0.1:1", "status_feed": "tcp://127.0.0.1:1"},
        {"name": "polled", "url": "http://127.0.0.1:2"}]}])  # fmt: skip
    table = RankTable(settings.groups)
    metrics = Metrics(table)
    assert b"ftproxy_feed_heartbeat_age_seconds{" not in metrics.render()  # never heard yet
    heartbeat = FeedMessage("heartbeat", "boot", 0, time.time(), [{"id": 0, "status": "healthy"}])
    PushFeed(table, Timeouts(), metrics)._apply("fed", heartbeat)
    table.ranks["fed"].pushed_at -= 7.0  # heard 7 s ago
    text = metrics.render().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("ftproxy_feed_heartbeat_age")]
    assert line.startswith('ftproxy_feed_heartbeat_age_seconds{rank="fed"} ')
    assert 7.0 <= float(line.split()[-1]) < 8.0


async def test_unknown_path_is_a_counted_refusal(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(replicas([a], logging=JSON_LOGS))
    out = capture(p)
    async with http.get(p.url + "/v1/no-such-thing") as r:
        assert r.status == 404
    (line,) = await lines(out, 1)
    assert line["status"] == 404 and line["end"] == End.REFUSED and line["ranks"] == []
    assert p.app[METRICS].refusals.labels("not_found")._value.get() == 1


FIELDS = ["ts", "level", "logger", "msg", "request_id", "method", "path", "status", "model",
          "group", "ranks", "queue_s", "ttfb_s", "duration_s", "prompt_tokens",
          "completion_tokens", "holds", "hold_s", "continuations", "end"]  # fmt: skip


def test_json_line_has_every_field_in_order_and_escapes_client_text() -> None:
    out = io.StringIO()
    rec = AccessRecord("r-2", "POST", '/v1/"x"\n\\é')
    rec.model, rec.status = 'm"\u2028\x00', 200
    rec.served_by("r0", "dp-a")
    rec.served_by('r"1', "dp-b")
    rec.usage_raw = b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}'
    AccessLog("json", out).write(rec)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    line = json.loads(text)
    assert list(line) == FIELDS
    assert line["path"] == '/v1/"x"\n\\é' and line["model"] == 'm"\u2028\x00'
    assert line["ranks"] == ["r0", 'r"1'] and line["group"] == "dp-b"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 4)
    assert line["end"] is None and line["ttfb_s"] is None and line["duration_s"] >= 0


def test_a_rank_s_usage_past_64_bits_is_no_count_and_costs_no_line() -> None:
    """A rank's answer says a count orjson cannot write: that record's count
    is unknown, and it and the records batched with it are still written."""
    out = io.StringIO()
    access = AccessLog("json", out)
    for rid, usage in (("before", b"3"), ("bad", b"99999999999999999999999"), ("after", b"4")):
        rec = AccessRecord(rid, "POST", "/v1/completions")
        rec.usage_raw = b'{"usage":{"prompt_tokens":%b,"completion_tokens":%b}}' % (usage, usage)
        access.write(rec)
    access.flush()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["request_id"], x["prompt_tokens"], x["completion_tokens"]) for x in lines] == [
        ("before", 3, 3),
        ("bad", None, None),
        ("after", 4, 4),
    ]


async def test_lines_are_batched_and_written_by_the_timer_or_on_close() -> None:
    out = io.StringIO()
    access = AccessLog("json", out)
    access.write(AccessRecord("a-1", "GET", "/health"))
    assert out.getvalue() == ""  # batched: not one write per request
    await asyncio.sleep(accesslog.FLUSH_S * 3)
    assert [json.loads(x)["request_id"] for x in out.getvalue().splitlines()] == ["a-1"]
    access.write(AccessRecord("a-2", "GET", "/health"))
    await access.close()  # the app stops: nothing pending is lost
    assert out.getvalue().count("\n") == 2
    for i in range(accesslog.FLUSH_LINES):  # a full batch is written at once
        access.write(AccessRecord(f"b-{i}", "GET", "/health"))
    assert out.getvalue().count("\n") == 2 + accesslog.FLUSH_LINES
    await access.close()


def test_writes_are_whole_lines_of_at_most_pipe_buf(monkeypatch) -> None:
    """Worker processes share stderr: a pipe keeps writes of <= PIPE_BUF whole."""
    lines = [f'{{"n":{i},"pad":"{"x" * (i % 700)}"}}\n'.encode() for i in range(400)]
    lines.append(b'{"long":"' + b"y" * 9000 + b'"}\n')  # longer than PIPE_BUF: alone
    lines += lines[:50]
    data = b"".join(lines)
    writes: list[bytes] = []
    real_write = os.write

    def write(fd: int, chunk: memoryview) -> int:
        writes.append(bytes(chunk))
        return real_write(fd, chunk)

    monkeypatch.setattr(accesslog.os, "write", write)
    with open(os.devnull, "wb") as null:
        accesslog.write_lines(null.fileno(), data)
    assert b"".join(writes) == data
    assert all(w.endswith(b"\n") for w in writes)
    assert all(len(w) <= accesslog.PIPE_BUF for w in writes if b"y" * 9000 not in w)
    assert len(writes) < len(lines) // 5  # batched, not one write per line


def test_worker_processes_never_interleave_inside_a_line() -> None:
    """Four processes write big batches into one pipe at once: every line whole."""
    code = (
        "import sys; from proxy.telemetry import accesslog\n"
        "me = sys.argv[1]\n"
        'line = (\'{"w":"%s","pad":"%s"}\\n\' % (me, me * 300)).encode()\n'
        "for _ in range(40): accesslog.write_lines(1, line * 200)\n"
    )
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", code, w], stdout=write, env=env)
             for w in "abcd"]  # fmt: skip
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        got = pipe.read().splitlines()
    assert all(p.wait(timeout=30) == 0 for p in procs)
    assert len(got) == 4 * 40 * 200
    for raw in got:
        line = json.loads(raw)
        assert line["pad"] == line["w"] * 300


def test_every_metric_is_in_the_readme_table() -> None:
    """On-call engineers look metrics up in the README: none may be missing."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("**Metrics**", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"`(ftproxy_[a-z_]+)`", table))
    rank = {"name": "r0", "url": "http://127.0.0.1:1", "status_feed": "tcp://127.0.0.1:1"}
    settings = Settings(groups=[{"name": "g", "ranks": [rank]}])
    metrics = Metrics(RankTable(settings.groups))
    names = {m.name + ("_total" if m.type == "counter" else "")
             for m in metrics.registry.collect()}  # fmt: skip
    assert len(names) > 20
    assert names - documented == set()
    assert documented - names == set()  # and no row for a metric that is gone


async def test_lines_pending_when_the_process_ends_are_written() -> None:
    out = io.StringIO()
    access = AccessLog("json", out)
    access.write(AccessRecord("last-1", "GET", "/health"))
    assert out.getvalue() == ""
    accesslog.flush_all()  # what a worker does before os._exit, and atexit
    assert json.loads(out.getvalue())["request_id"] == "last-1"
    await access.close()


async def test_a_burst_of_ends_is_formatted_later_in_order_with_its_end_counts() -> None:
    """64 streams that end together: their records are completed at their
    ends and formatted when the batch is written, every line, in order, with
    the tokens counted at the end (the book is not kept, nor read again)."""
    out = io.StringIO()
    access = AccessLog("json", out)
    books: list[list[int]] = []
    for i in range(64):
        rec = AccessRecord(f"s-{i}", "POST", "/v1/completions")
        book = [7] * i
        rec.tokens = lambda book=book: (3, len(book))
        rec.status, rec.end = 200, End.FINISHED
        access.write(rec)
        book.append(8)  # what a book does after its request ended is not the line's
        books.append(book)
    assert out.getvalue() == ""  # batched: nothing formatted or written on the ends' path
    assert all(rec.tokens is None for rec in access.pending)  # the books are not kept
    got = await lines(out, 64)
    assert [line["request_id"] for line in got] == [f"s-{i}" for i in range(64)]
    assert [line["completion_tokens"] for line in got] == list(range(64))
    assert all(line["prompt_tokens"] == 3 and line["end"] == End.FINISHED for line in got)
    await access.close()


async def test_a_graceful_stop_writes_the_lines_still_batched(
    fakes, proxy, http, monkeypatch
) -> None:
    monkeypatch.setattr(accesslog, "FLUSH_S", 60.0)  # only the stop writes the batch
    a = await fakes(name="a")
    p = await proxy(settings_for([a], shutdown={"ready_delay_s": 0, "grace_s": 1},
                                 logging=JSON_LOGS))  # fmt: skip
    out = capture(p)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        await r.read()
    for _ in range(500):  # the request's end is in (its line is batched, not yet written)
        if p.drain.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    access = p.app[ACCESS_LOG]
    assert access is not None and len(access.pending) == 1 and out.getvalue() == ""
    await p.graceful_stop()
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["end"] == End.FINISHED and line["completion_tokens"] == 3
