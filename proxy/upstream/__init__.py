"""The proxy's one boundary to its ranks, and header hygiene.

:class:`Upstream` owns every connection to a rank, with its timeouts, TLS,
size bounds and keep-alive: the relay's client requests and their
continuations (:attr:`Upstream.relay`), and the proxy's own side requests
(status polls, ``/health``, model lists, recovery calls) through
:meth:`Upstream.get` and :meth:`Upstream.post_json`, each read whole within
its :class:`~proxy.upstream.bounded.Bound` in size, time and JSON depth (a
connection is pooled after an answer read for its JSON only when it is). Every
transport failure is a :class:`~proxy.core.errors.RankError`. Upstream only
sends and reads; which rank to use is the balancer's call.
"""

from __future__ import annotations

import json as jsonlib
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.settings import Timeouts
from proxy.upstream.bounded import Answer, Bound, fetch
from proxy.upstream.client import RankClient

# RFC 9110 hop-by-hop headers, plus those the rank client writes itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


# The body goes on decoded (proxy.ingress.inbound), so its encoding header does not;
# the client's Accept-Encoding is not the proxy's (see request_headers).
_NOT_TO_RANK = _HOP_BY_HOP | {"content-encoding", "accept-encoding"}
_NOT_TO_RANK_NOR_AUTH = _NOT_TO_RANK | {"authorization"}


def make_rank_client(
    t: Timeouts, per_rank: int = 0, tls: ssl.SSLContext | bool = True
) -> RankClient:
    """A client with the proxy's timeouts: a request waits for a free
    connection as long as for a healthy rank (``queue_s``); ``tls`` as
    proxy.core.tls.UpstreamTLS.context gives it. Must be called with the loop running."""
    return RankClient(t.connect_s, t.read_s, t.upstream_idle_s, per_rank, tls, t.queue_s)


class Upstream:
    """Every connection to the ranks. Must be made with the loop running.

    Side requests have a pool of their own, with the same bounds: streams
    may hold each of a rank's ``per_rank`` relay connections for minutes, and
    a status poll queued behind them would read as the rank down.

    ``api_key`` (``upstream_api_key``): the ranks' own key (vLLM's
    ``--api-key``), sent on every side request; the relay's requests get it
    from :func:`request_headers`."""

    def __init__(
        self,
        t: Timeouts,
        per_rank: int = 0,
        tls: ssl.SSLContext | bool = True,
        api_key: str | None = None,
    ) -> None:
        self.relay = make_rank_client(t, per_rank, tls)
        self.side = make_rank_client(t, per_rank, tls)
        self.api_key = api_key  # read at start, as TLS: a reload keeps it
        # Answers are asked for uncompressed (proxy.upstream.bounded), whatever is sent.
        get = {"Accept-Encoding": "identity"}
        if api_key is not None:
            get["Authorization"] = f"Bearer {api_key}"
        self._get_headers = CIMultiDictProxy(CIMultiDict(get))
        self._post_headers = CIMultiDictProxy(
            CIMultiDict({**get, "Content-Type": "application/json"})
        )

    async def get(self, rank_url: str, path: str, bound: Bound, *, json: bool = True) -> Answer:
        """``GET path`` of the rank, its answer read whole within ``bound``;
        ``json``: read for its JSON, as :func:`~proxy.upstream.bounded.fetch` says."""
        url, headers = rank_url + path, self._get_headers
        return await fetch(self.side, "GET", url, bound, b"", headers, json=json)

    async def post_json(self, rank_url: str, path: str, body: Any, bound: Bound) -> Answer:
        """``POST path`` of the rank with ``body`` as JSON, as :meth:`get`."""
        raw = jsonlib.dumps(body).encode()
        return await fetch(self.side, "POST", rank_url + path, bound, raw, self._post_headers)

    async def close(self) -> None:
        await self.relay.close()
        await self.side.close()


def request_headers(
    incoming: Mapping[str, str], request_id: str, strip_auth: bool, rank_key: str | None = None
) -> CIMultiDict[str]:
    """A client's headers for the rank. With ``rank_key`` the rank gets its
    own key, never the client's (which may be the proxy's, or none)."""
    strip_auth = strip_auth or rank_key is not None
    out = _this_hop_dropped(incoming.items(), _NOT_TO_RANK_NOR_AUTH if strip_auth else _NOT_TO_RANK)
    # The proxy reads generation answers (holds, continuations): uncompressed.
    out["Accept-Encoding"] = "identity"
    out["X-Request-Id"] = request_id
    if rank_key is not None:
        out["Authorization"] = f"Bearer {rank_key}"
    return out


def response_headers(upstream: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """A rank's answer headers (``RankResponse.header_items()``) for the client."""
    return _this_hop_dropped(upstream, _HOP_BY_HOP)


def _this_hop_dropped(
    headers: Iterable[tuple[str, str]], dropped: frozenset[str]
) -> CIMultiDict[str]:
    """``headers`` without those named in ``dropped`` (lower case) and those
    a ``Connection`` header names: RFC 9110 §7.6.1, they are this hop's
    (``Connection: keep-alive, X-Secret``), never forwarded."""
    out: CIMultiDict[str] = CIMultiDict()
    named: list[str] = []
    for k, v in headers:
        lk = k.lower()
        if lk == "connection":
            named.append(v)
        elif lk not in dropped:
            out.add(k, v)
    for value in named:  # most requests name nothing
        for name in value.split(","):
            out.popall(name.strip(), None)
    return out
