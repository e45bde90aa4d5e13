"""Where the proxy's HTTP clients to ranks are made, and header hygiene.

Upstream only sends and closes; which rank to use is the balancer's call.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable, Mapping

import aiohttp
from multidict import CIMultiDict

from proxy.rankclient import RankClient
from proxy.settings import Timeouts

# RFC 9110 hop-by-hop headers, plus those aiohttp recomputes itself.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


# The body goes on decoded (proxy.inbound), so its encoding header does not;
# the client's Accept-Encoding is not the proxy's (see request_headers).
_ENCODINGS = frozenset({"content-encoding", "accept-encoding"})


def make_rank_client(
    t: Timeouts, per_rank: int = 0, tls: ssl.SSLContext | bool = True
) -> RankClient:
    """The relay's client for client requests (and their continuations):
    ``per_rank`` connections per rank at most, idle ones closed after
    ``upstream_idle_s``; a request waits for a free one as long as for a
    healthy rank (``queue_s``). ``tls``: for https:// ranks, as for
    :func:`make_session`. Must be called with the loop running."""
    return RankClient(t.connect_s, t.read_s, t.upstream_idle_s, per_rank, tls, t.queue_s)


def make_session(
    t: Timeouts, per_rank: int = 0, tls: ssl.SSLContext | bool = True
) -> aiohttp.ClientSession:
    """The session for the proxy's own calls to ranks (status polls, model
    lists, recovery): ``per_rank`` connections per rank at most, idle ones
    closed after ``upstream_idle_s``. ``tls``: for https:// ranks
    (proxy.tls.UpstreamTLS.context: a context, True for the system's, False
    to encrypt without verifying)."""
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=per_rank,
        keepalive_timeout=t.upstream_idle_s,
        ssl=tls,
        ttl_dns_cache=300,
        enable_cleanup_closed=True,
    )
    # sock_connect, not connect: waiting for a free pooled connection is not a
    # rank failing to accept one.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.read_s)
    # The proxy reads these answers itself, bounded as they are sent
    # (proxy.bounded): it asks for them uncompressed and never inflates one,
    # so a bomb cannot inflate past its bound before it is counted. aiohttp
    # offers gzip unless told otherwise, and a rank that took the offer
    # failed every poll.
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        trust_env=False,
        headers={"Accept-Encoding": "identity"},
        cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies of its own
    )


def request_headers(
    incoming: Mapping[str, str], request_id: str, strip_auth: bool
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for k, v in incoming.items():
        lk = k.lower()
        if lk == "connection":
            named.append(v)
        # The body goes on decoded (proxy.inbound), so its encoding header does not.
        if lk in _HOP_BY_HOP or lk in _ENCODINGS or (strip_auth and lk == "authorization"):
            continue
        out.add(k, v)
    _drop_named(out, named)
    # The proxy reads generation answers (holds, continuations): uncompressed.
    out["Accept-Encoding"] = "identity"
    out["X-Request-Id"] = request_id
    return out


def response_headers(upstream: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """A rank's answer headers (``RankResponse.header_items()``) for the client."""
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for k, v in upstream:
        lk = k.lower()
        if lk == "connection":
            named.append(v)
        elif lk not in _HOP_BY_HOP:
            out.add(k, v)
    _drop_named(out, named)
    return out


def _drop_named(headers: CIMultiDict[str], connection: list[str]) -> None:
    """RFC 9110 §7.6.1: the fields a ``Connection`` header names are this
    hop's (``Connection: keep-alive, X-Secret``), never forwarded."""
    for value in connection:
        for name in value.split(","):
            headers.popall(name.strip(), None)
