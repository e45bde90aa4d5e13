"""etcd's v3 JSON gateway: the handful of calls the proxy needs, each answer
checked for etcd's shape before anything reads it.

Every answer, and every message of the watch stream, is read through
:mod:`proxy.upstream.bounded`: at most ``max_answer_bytes``, within ``timeout_s``. An
answer not of its call's shape (not a JSON object, a list that is not one, a
lease without its id, a ``succeeded`` that is not a boolean) fails the call.
One entry not of its shape inside an answer that is (a key-value without a
key, a key that is not base64 UTF-8, a revision that is no number, a watch
event without ``kv``) is skipped, logged and counted
(``ftproxy_etcd_skipped_total{reason="entry"}``), and the rest is kept; a watch
message that is not of the gateway's shape is skipped the same way
(``reason="message"``) and tells the watcher that anything may have changed.

Errors: :class:`EtcdError` for everything that fails a call (transport,
timeouts, an answer over its bound, not JSON or not of its shape, HTTP errors).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict
from prometheus_client import Counter

from proxy.core.errors import EtcdError, RankError
from proxy.core.settings import EtcdConfig
from proxy.core.throttle import Throttle
from proxy.upstream.bounded import Bound, fetch, lines, parse_json, read_body, send
from proxy.upstream.client import RankClient

log = logging.getLogger("ftproxy.coordination")

_INT = re.compile(r"-?[0-9]{1,20}")  # int64 fields: JSON strings in the gateway's mapping
# Idle connections to etcd are closed after this long.
_IDLE_S = 15.0


# What one endpoint's answer may raise: all of it fails the call there, and
# the next endpoint is asked (an HTTP error included: a member cut off from
# its cluster answers 503 while the others serve).
_FAILURES = (EtcdError, RankError, TimeoutError, ValueError, TypeError)


@dataclass(frozen=True)
class Stored:
    """A key's value as etcd holds it, and the revision that last wrote it."""

    value: bytes  # b"" when empty: the gateway leaves an empty value out
    revision: int


class Junk:
    """What a malformed entry or message costs: a count by reason, and a log
    line (at most once a minute for each reason and place: a junk key stays
    and is read again on every tick)."""

    def __init__(self, skipped: Counter | None = None) -> None:
        self.skipped = skipped
        self._logged = Throttle()

    def skip(self, reason: str, where: str, why: str) -> None:
        if self.skipped is not None:
            self.skipped.labels(reason).inc()
        if self._logged.due((reason, where)):
            log.warning(
                "%s: %s skipped, not of its shape (%s; logged once a minute)", where, reason, why
            )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def prefix_end(prefix: str) -> str:
    """etcd's range_end for "every key starting with prefix"."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def _unb64(field: Any) -> bytes:
    if not isinstance(field, str):
        raise ValueError(f"not base64 text: {type(field).__name__}")
    try:
        return base64.b64decode(field, validate=True)
    except binascii.Error as e:
        raise ValueError(f"not base64: {e}") from None


def _int(field: Any) -> int:
    if isinstance(field, int) and not isinstance(field, bool):
        return field
    if isinstance(field, str) and _INT.fullmatch(field):
        return int(field)
    raise ValueError(f"not a number: {str(field)[:40]!r}")


def _entry(kv: Any) -> tuple[str, Stored]:
    """A key-value of a range answer or watch event (ValueError: not its shape)."""
    if not isinstance(kv, dict):
        raise ValueError(f"not an object: {str(kv)[:40]!r}")
    key = _unb64(kv.get("key")).decode()  # UnicodeDecodeError is a ValueError
    value = _unb64(kv.get("value", ""))
    return key, Stored(value, _int(kv.get("mod_revision", 0)))


class Client:
    """The etcd v3 gateway calls the proxy needs."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self.junk = Junk()
        self.bound = Bound("etcd", cfg.max_answer_bytes, cfg.timeout_s)
        self._client: RankClient | None = None
        self._token: str | None = None
        # The endpoint that answered last is asked first: one that never
        # answers would cost every call timeout_s, and a tick of a few calls
        # would outlast the lease.
        self._first = 0

    def _endpoints(self) -> list[tuple[int, str]]:
        endpoints = list(enumerate(self.cfg.endpoints))
        return endpoints[self._first :] + endpoints[: self._first]

    def count_into(self, skipped: Counter, too_large: Counter) -> None:
        """Count skipped entries and answers over the bound in these from now on."""
        self.junk.skipped, self.bound.counter = skipped, too_large

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None  # a restarted coordinator opens a new one

    def _ssl(self) -> ssl.SSLContext | None:
        if not any(u.startswith("https://") for u in self.cfg.endpoints):
            return None
        ctx = ssl.create_default_context(cafile=str(self.cfg.ca_file) if self.cfg.ca_file else None)
        if self.cfg.cert_file is not None:
            key = str(self.cfg.key_file) if self.cfg.key_file else None
            ctx.load_cert_chain(str(self.cfg.cert_file), key)
        return ctx

    def _open(self) -> RankClient:
        """The same client as the ranks' (plain HTTP/1.1 and JSON, bounded
        by :mod:`proxy.upstream.bounded`). No silence limit of its own: each call has
        its deadline (``timeout_s``), and the watch stream idles between
        changes for as long as nothing changes."""
        if self._client is None:
            timeout = self.cfg.timeout_s
            self._client = RankClient(timeout, None, _IDLE_S, tls=self._ssl() or True)
        return self._client

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for index, endpoint in self._endpoints():  # the first that answers
            try:
                answer = await self._post(endpoint, path, body)
            except _FAILURES as e:  # a body that is not etcd's JSON is no answer either
                last = e
                continue
            self._first = index
            return answer
        raise EtcdError(f"no etcd endpoint answered {path}: {last!r}")

    async def _auth(self, endpoint: str) -> dict[str, str]:
        """The headers a call needs (logs in first when etcd auth is on)."""
        client = self._open()
        if self.cfg.username and self._token is None:
            password = self.cfg.password.get_secret_value() if self.cfg.password else ""
            login = {"name": self.cfg.username, "password": password}
            url = endpoint + "/v3/auth/authenticate"
            reply = await fetch(client, "POST", url, self.bound, _json(login), _headers())
            answer = reply.json()
            token = answer.get("token") if isinstance(answer, dict) else None
            if reply.status != 200 or not isinstance(token, str) or not token:
                raise EtcdError(f"etcd refused the login: {str(answer)[:200]}")
            self._token = token
        return {"Authorization": self._token} if self._token else {}

    async def _post(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = _headers(await self._auth(endpoint))
        url = endpoint + path
        reply = await fetch(self._open(), "POST", url, self.bound, _json(body), headers)
        if reply.status == 401 and self._token:
            self._token = None  # expired: log in again next time
        if reply.status != 200:
            raise EtcdError(f"etcd {path}: HTTP {reply.status}: {reply.body[:200]!r}")
        answer = reply.json()
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd {path}: the answer is not an object: {str(answer)[:100]!r}")
        return answer

    async def watch(self, prefix: str) -> AsyncIterator[list[str] | None]:
        """Follow every change under ``prefix`` (the gateway's ``/v3/watch``, one
        JSON message a line): the keys of each batch of events, or None when
        anything may have changed (the watch was created, or a message or an
        event of it could not be read). Ends with EtcdError when the stream
        breaks, is cancelled, or sends a message over the bound or cut short."""
        client = self._open()
        body = _json({"create_request": {"key": b64(prefix), "range_end": prefix_end(prefix)}})
        last: Exception | None = None
        for index, endpoint in self._endpoints():
            try:
                headers = _headers(await self._auth(endpoint))
                url = endpoint + "/v3/watch"
                async with asyncio.timeout(self.bound.within_s):  # its head; then lines()
                    r = await send(client, "POST", url, headers, body)
                # The stream idles between changes; a dead etcd closes it, and
                # the lease ticks notice it meanwhile.
                try:
                    if r.status != 200:
                        answer = await read_body(r, self.bound, url)
                        raise EtcdError(f"etcd /v3/watch: HTTP {r.status}: {answer[:200]!r}")
                    self._first = index
                    async for line in lines(r, self.bound, url):
                        keys = self._watched(line) if line.strip() else []
                        if keys != []:  # [] : a message that changed nothing
                            yield keys
                finally:
                    r.close()
                last = EtcdError("etcd closed the watch")
            except _FAILURES as e:
                last = e
        raise EtcdError(f"no etcd endpoint kept the watch on {prefix}: {last!r}")

    def _watched(self, line: bytes) -> list[str] | None:
        """What one watch message says changed (None: anything may have)."""
        try:
            message = parse_json(line)
        except ValueError as e:
            self.junk.skip("message", "etcd watch", f"not JSON: {e}")
            return None
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict):
            if isinstance(message, dict) and "error" in message:
                raise EtcdError(f"etcd ended the watch: {str(message)[:200]}")
            self.junk.skip("message", "etcd watch", f"no result: {str(message)[:60]!r}")
            return None
        if result.get("canceled"):
            raise EtcdError(f"etcd ended the watch: {str(message)[:200]}")
        events = result.get("events", [])
        if not isinstance(events, list):
            self.junk.skip("message", "etcd watch", f"events: {str(events)[:60]!r}")
            return None
        keys = self._event_keys(events)
        return None if keys is None or result.get("created") else keys

    def _event_keys(self, events: list[Any]) -> list[str] | None:
        keys: list[str] | None = []
        for event in events:
            try:
                key, _ = _entry(event.get("kv") if isinstance(event, dict) else None)
            except ValueError as e:
                self.junk.skip("entry", "etcd watch", f"an event: {e}")
                keys = None  # which key it was is lost: anything may have changed
                continue
            if keys is not None:
                keys.append(key)
        return keys

    # -- kv -----------------------------------------------------------------------
    async def get(self, key: str) -> Stored | None:
        return (await self._range(key, prefix=False)).get(key)

    async def get_prefix(self, prefix: str) -> dict[str, Stored]:
        return await self._range(prefix, prefix=True)

    async def _range(self, start: str, prefix: bool) -> dict[str, Stored]:
        """``start`` alone, or every key beginning with it; an entry of another
        key is not one the range asked for, and is skipped."""
        body = {"key": b64(start)}
        if prefix:
            body["range_end"] = prefix_end(start)
        kvs = (await self.call("/v3/kv/range", body)).get("kvs", [])
        if not isinstance(kvs, list):
            raise EtcdError(f"etcd /v3/kv/range: kvs is not a list: {str(kvs)[:100]!r}")
        found: dict[str, Stored] = {}
        for kv in kvs:
            try:
                key, stored = _entry(kv)
            except ValueError as e:
                self.junk.skip("entry", "etcd range", str(e))
                continue
            if not (key.startswith(start) if prefix else key == start):
                self.junk.skip("entry", "etcd range", f"key {key[:60]!r} outside the range")
                continue
            found[key] = stored
        return found

    async def put(self, key: str, value: Any, lease: str | None = None) -> None:
        await self.call("/v3/kv/put", _put(key, value, lease))

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": b64(key)})

    async def delete_if(self, key: str, value: Any) -> bool:
        """Delete ``key`` only while it still holds ``value``."""
        compare = {"key": b64(key), "target": "VALUE", "value": _json64(value)}
        success = [{"request_delete_range": {"key": b64(key)}}]
        return await self._txn({"compare": [compare], "success": success})

    async def put_if(self, key: str, value: Any, holding: dict[str, Any]) -> bool:
        """Put ``key`` only while every key of ``holding`` holds its value there."""
        compare = [
            {"key": b64(k), "target": "VALUE", "value": _json64(v)} for k, v in holding.items()
        ]
        success = [{"request_put": _put(key, value, None)}]
        return await self._txn({"compare": compare, "success": success})

    async def create(
        self,
        key: str,
        value: Any,
        lease: str | None = None,
        also: list[tuple[str, Any, str | None]] | None = None,
        mod_revision: int = 0,
    ) -> bool:
        """Put ``key`` only if it is absent (or still at ``mod_revision``)."""
        if mod_revision:
            compare = {"key": b64(key), "target": "MOD", "mod_revision": str(mod_revision)}
        else:
            compare = {"key": b64(key), "target": "CREATE", "create_revision": "0"}
        puts = [(key, value, lease), *(also or [])]
        success = [{"request_put": _put(k, v, ls)} for k, v, ls in puts]
        return await self._txn({"compare": [compare], "success": success})

    async def _txn(self, body: dict[str, Any]) -> bool:
        succeeded = (await self.call("/v3/kv/txn", body)).get("succeeded", False)
        if not isinstance(succeeded, bool):  # "false" is a truthy string
            raise EtcdError(f"etcd /v3/kv/txn: succeeded is {str(succeeded)[:40]!r}")
        return succeeded

    # -- leases -------------------------------------------------------------------
    async def grant(self, ttl: int) -> str:
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        try:
            if answer.get("error"):
                raise ValueError(str(answer["error"])[:200])
            if _int(answer.get("TTL")) <= 0:
                raise ValueError("no time to live")
            lease = _int(answer.get("ID"))
            if lease <= 0:  # 0 is etcd's "no lease": keys put on it would never expire
                raise ValueError(f"lease id {lease}")
            return str(lease)
        except ValueError as e:
            raise EtcdError(f"etcd granted no lease: {e}") from None

    async def keepalive(self, lease: str) -> bool:
        """Renew the lease; False when it has already expired."""
        result = (await self.call("/v3/lease/keepalive", {"ID": lease})).get("result")
        if not isinstance(result, dict):
            raise EtcdError(f"etcd /v3/lease/keepalive: no result: {str(result)[:100]!r}")
        try:
            return _int(result.get("TTL", 0)) > 0  # left out when 0: expired or unknown
        except ValueError as e:
            raise EtcdError(f"etcd /v3/lease/keepalive: TTL {e}") from None

    async def revoke(self, lease: str) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _headers(auth: dict[str, str] | None = None) -> CIMultiDict[str]:
    """A call's headers. Bytes as etcd sent them: a compressed answer is
    bounded as sent, never inflated past the bound first."""
    headers = CIMultiDict({"Accept-Encoding": "identity", "Content-Type": "application/json"})
    headers.update(auth or {})
    return headers


def _json64(value: Any) -> str:
    return b64(json.dumps(value))


def _put(key: str, value: Any, lease: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": _json64(value)}
    if lease:
        body["lease"] = lease
    return body
