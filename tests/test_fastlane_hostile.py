"""The fast lane against hostile byte streams: heads aiohttp's own checks
refuse before they end, requests held at the request limit, and the byte
streams on which the lane and aiohttp's path part on purpose.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.server import Running
from tests.test_fastlane import BODY, _lane, both, head
from tests.test_fastlane_review import _pair_with, aiohttp_reads

_LINE = b"POST /v1/completions HTTP/1.1\r\n"
# Header lines a head is built of: singletons (aiohttp refuses a second),
# lines the lane leaves to aiohttp, and plain ones.
_FIELDS = st.sampled_from([b"Host: proxy", b"Content-Type: application/json",
                           b"Content-Length: 5", b"User-Agent: u", b"Server: s", b"ETag: e",
                           b"Max-Forwards: 1", b"Content-Location: /x", b"Content-Range: r",
                           b"Transfer-Encoding: chunked", b"Sec-WebSocket-Key1: k",
                           b"Upgrade: websocket", b"Connection: upgrade", b"X-A: v"])  # fmt: skip
_HOSTILE = st.sampled_from([b"\r", b"\n", b"\x00", b" ", b"\t", b":", b"\x7f", b"\x80", b"\xff",
                            b"\x01", b"\r\n", b"\r\n ", b","])  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.one_of(st.lists(_FIELDS, max_size=8), st.lists(_FIELDS, min_size=120, max_size=140)),
    inserts=st.lists(st.tuples(st.integers(0, 10_000), _HOSTILE), max_size=2),
    cut=st.integers(0, 10_000),
)
def test_a_head_the_lane_waits_for_is_one_aiohttp_has_not_refused(fields, inserts, cut) -> None:
    """A head still coming that the lane waits for (parse gives 0), aiohttp's
    parser has not refused yet either: if it has, the lane hands it on at
    once rather than leave the client to the header timeout's 408."""
    raw = bytearray(_LINE + b"".join(f + b"\r\n" for f in fields))
    for at, byte in inserts:
        at = at % (len(raw) + 1)
        raw[at:at] = byte
    part = bytes(raw[: cut % (len(raw) + 1)])
    if _lane().parse(part) == 0:
        assert aiohttp_reads(part) is not None, part


@pytest.fixture
async def lanes(fakes, proxy) -> tuple[Running, Running]:
    """Two proxies over one fake rank: the lane on, the lane off."""
    on, off, _ = await _pair_with(fakes, proxy)
    return on, off


@pytest.mark.parametrize(
    "more",
    [
        b"Host: again\r\nX",  # a repeated singleton, then the next header begins
        b"".join(b"X-%d: v\r\n" % i for i in range(130)),  # over aiohttp's 128 headers
    ],
)
async def test_a_head_aiohttp_refuses_before_its_end_is_refused_at_once(lanes, more) -> None:
    raw = head(BODY).removesuffix(b"\r\n") + more  # no end of head: the client stalls
    (answer,) = await both(lanes, raw)
    assert answer.status == 400
