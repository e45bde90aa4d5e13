"""etcd: one recovery driver, one round per group, shared weights, any scale.

Spoken over etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``) with the
aiohttp client the proxy already has: no extra dependency, no gRPC stack, and
the few calls below are all it needs. Keys under ``prefix``:

``leader/<group>``        one process's id, on its lease: it alone starts
                          the group's automatic rounds and takes over its
                          orphaned rounds (each group has its own leader)
``members/<id>``          every live process, on its lease: the groups'
                          leaderships are spread over them
``rounds/<group>``        the group's latest round: id, instruction, params,
                          targets, state (``waiting`` -> ``sent`` -> ``done``)
                          and, once done, the report every caller gets
``rounds/<group>/owner``  the process driving it, on its lease
``weights/<rank>``        live weight overrides, applied by every process
                          and re-applied after each reload
``removed/<rank>``        ranks a scale_down took out of their group: no
                          process judges the group by them any more

Every process watches the whole prefix (one ``/v3/watch`` stream): a weight
PATCH, a round's progress and a leader key that expired reach the others as
they happen, with a full re-read every few seconds as a safety net and
polling while the watch is down.

A round is created with a compare-and-swap, so two callers anywhere never
start two: the loser joins (same work) or gets 409 (other work). The owner
writes ``sent`` before it sends anything. When the owner dies its lease
expires and the group's leader takes the round over: ``waiting`` -> it runs the
round from the start under the same id (nothing was sent); ``sent`` -> it
only watches the ranks and writes the report. Never two fan-outs per round.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp

from proxy.coordination import Coordination
from proxy.errors import ProxyError, RoundInProgress
from proxy.recovery import RankReport, RoundReport, RoundSpec
from proxy.settings import EtcdConfig

log = logging.getLogger("ftproxy.coordination")

# What the prefix watch wakes up: the kind of a key is its first part.
KINDS = ("leader", "rounds", "weights")
SAME_AS = {"removed": "weights"}  # read together with the weights
# Without a watch (etcd just restarted, the stream broke) a joiner looks at
# the round, and every process at the weight overrides, this often ...
POLL_S = 0.2
# ... and with one, they re-read this often anyway: a safety net for a
# change the watch missed, not the way changes arrive.
RESYNC_S = 5.0
WATCH_RETRY_S = 1.0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    """etcd's range_end for "every key starting with prefix"."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class EtcdError(ProxyError):
    """etcd did not answer or refused; an admin call gets 503."""

    status, type, code = 503, "server_error", "coordination_unavailable"


class Client:
    """The handful of etcd v3 gateway calls the proxy needs."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None  # a restarted coordinator opens a new one

    def _ssl(self) -> ssl.SSLContext | None:
        if not any(u.startswith("https://") for u in self.cfg.endpoints):
            return None
        ctx = ssl.create_default_context(cafile=str(self.cfg.ca_file) if self.cfg.ca_file else None)
        if self.cfg.cert_file is not None:
            key = str(self.cfg.key_file) if self.cfg.key_file else None
            ctx.load_cert_chain(str(self.cfg.cert_file), key)
        return ctx

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
            connector = aiohttp.TCPConnector(ssl=self._ssl() or True)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._open()
        last: Exception | None = None
        for endpoint in self.cfg.endpoints:  # the first that answers
            try:
                return await self._post(endpoint, path, body)
            # ValueError, TypeError: a body that is not etcd's JSON (e.g. an
            # HTML 502 from something in front of etcd) is no answer either.
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, TypeError) as e:
                last = e
        raise EtcdError(f"no etcd endpoint answered {path}: {last!r}")

    async def _auth(self, endpoint: str) -> dict[str, str]:
        """The headers a call needs (logs in first when etcd auth is on)."""
        assert self._session is not None
        if self.cfg.username and self._token is None:
            password = self.cfg.password.get_secret_value() if self.cfg.password else ""
            async with self._session.post(endpoint + "/v3/auth/authenticate",
                                          json={"name": self.cfg.username,
                                                "password": password}) as r:  # fmt: skip
                answer = await r.json(content_type=None)
                if r.status != 200 or "token" not in answer:
                    raise EtcdError(f"etcd refused the login: {answer}")
                self._token = answer["token"]
        return {"Authorization": self._token} if self._token else {}

    async def _post(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = await self._auth(endpoint)
        assert self._session is not None
        async with self._session.post(endpoint + path, json=body, headers=headers) as r:
            answer = await r.json(content_type=None)
        if r.status == 401 and self._token:
            self._token = None  # expired: log in again next time
        if r.status != 200:
            raise EtcdError(f"etcd {path}: HTTP {r.status}: {answer}")
        return dict(answer)

    async def watch(self, prefix: str) -> AsyncIterator[list[str] | None]:
        """Follow every change under ``prefix`` (the gateway's ``/v3/watch``, one
        JSON message a line): None once the watch is created, then the keys of
        each batch of events. Ends with EtcdError when the stream breaks."""
        session = self._open()
        body = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix)}}
        # No total timeout: the stream is meant to stay open; a dead etcd
        # closes the connection (and the lease ticks notice it meanwhile).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.timeout_s)
        last: Exception | None = None
        for endpoint in self.cfg.endpoints:
            try:
                headers = await self._auth(endpoint)
                async with session.post(endpoint + "/v3/watch", json=body, headers=headers,
                                        timeout=timeout) as r:  # fmt: skip
                    if r.status != 200:
                        raise EtcdError(f"etcd /v3/watch: HTTP {r.status}: {await r.text()}")
                    async for line in r.content:
                        if not line.strip():
                            continue
                        message = json.loads(line)
                        result = message.get("result")
                        if result is None or result.get("canceled"):
                            raise EtcdError(f"etcd ended the watch: {message}")
                        if result.get("created"):
                            yield None
                        events = result.get("events") or []
                        if events:
                            yield [_unb64(e["kv"]["key"]) for e in events]
                last = EtcdError("etcd closed the watch")
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, TypeError) as e:
                last = e
        raise EtcdError(f"no etcd endpoint kept the watch on {prefix}: {last!r}")

    # -- kv -----------------------------------------------------------------------
    async def get(self, key: str) -> tuple[Any, int]:
        """The JSON value and mod revision of ``key`` (None, 0 when absent)."""
        answer = await self.call("/v3/kv/range", {"key": _b64(key)})
        for kv in answer.get("kvs") or []:
            return json.loads(_unb64(kv["value"])), int(kv.get("mod_revision", 0))
        return None, 0

    async def get_prefix(self, prefix: str) -> dict[str, str]:
        answer = await self.call(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        )
        return {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in answer.get("kvs") or []}

    async def put(self, key: str, value: Any, lease: str | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(json.dumps(value))}
        if lease:
            body["lease"] = lease
        await self.call("/v3/kv/put", body)

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key)})

    async def delete_if(self, key: str, value: Any) -> bool:
        """Delete ``key`` only while it still holds ``value``."""
        compare = {"key": _b64(key), "target": "VALUE", "value": _b64(json.dumps(value))}
        answer = await self.call("/v3/kv/txn", {"compare": [compare],
                                                "success": [{"request_delete_range":
                                                             {"key": _b64(key)}}]})  # fmt: skip
        return bool(answer.get("succeeded"))

    async def create(self, key: str, value: Any, lease: str | None = None,
                     also: list[tuple[str, Any, str | None]] | None = None,
                     mod_revision: int = 0) -> bool:  # fmt: skip
        """Put ``key`` only if it is absent (or still at ``mod_revision``)."""
        if mod_revision:
            compare = {"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision)}
        else:
            compare = {"key": _b64(key), "target": "CREATE", "create_revision": "0"}
        puts = [(key, value, lease), *(also or [])]
        success = []
        for k, v, ls in puts:
            put: dict[str, Any] = {"key": _b64(k), "value": _b64(json.dumps(v))}
            if ls:
                put["lease"] = ls
            success.append({"request_put": put})
        answer = await self.call("/v3/kv/txn", {"compare": [compare], "success": success})
        return bool(answer.get("succeeded"))

    # -- leases -------------------------------------------------------------------
    async def grant(self, ttl: int) -> str:
        answer = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return str(answer["ID"])

    async def keepalive(self, lease: str) -> bool:
        """Renew the lease; False when it has already expired."""
        answer = await self.call("/v3/lease/keepalive", {"ID": lease})
        return int((answer.get("result") or {}).get("TTL", 0)) > 0

    async def revoke(self, lease: str) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})


class Etcd(Coordination):
    name = "etcd"
    shared_rounds = True

    def __init__(self, cfg: EtcdConfig, groups: Iterable[str] = ()) -> None:
        super().__init__()
        self._leader.clear()
        self.cfg = cfg
        self.client = Client(cfg)
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # One leader key per group, all on this process's lease. A group asked
        # about later (wait_leader) is campaigned for from then on.
        self._leads: dict[str, asyncio.Event] = {g: asyncio.Event() for g in groups}
        self._unled: dict[str, int] = {}  # ticks a group has been seen without a leader
        # Changes seen by the watch, by kind; _wake is set (and replaced) on each.
        self._seq: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._wake = asyncio.Event()
        self.watching = False
        self.lease: str | None = None
        self._leased = asyncio.Event()
        self._taken: set[str] = set()  # rounds this process took over
        self._tasks: set[asyncio.Task[Any]] = set()

    def _key(self, *parts: str) -> str:
        return "/".join([self.cfg.prefix.rstrip("/"), *parts])

    # -- lease and leadership -----------------------------------------------------
    def is_leader(self, group: str | None = None) -> bool:
        if group is None:
            return any(e.is_set() for e in self._leads.values())
        event = self._leads.get(group)
        return event is not None and event.is_set()

    async def wait_leader(self, group: str | None = None) -> None:
        if group is None:
            await self._leader.wait()  # set while this process leads any group
            return
        await self._leads.setdefault(group, asyncio.Event()).wait()

    def _step_down(self, why: str, level: int = logging.WARNING) -> None:
        led = sorted(g for g, e in self._leads.items() if e.is_set())
        if led:
            log.log(level, "%s: %s stops leading recovery of %s", why, self.me, ", ".join(led))
        for event in self._leads.values():
            event.clear()
        self._leader.clear()

    async def run(self) -> None:
        """Keep a lease, campaign for each group, take over orphaned rounds."""
        every = max(self.cfg.lease_ttl_s / 3, 0.3)
        watcher = asyncio.create_task(self._watch())
        self._tasks.add(watcher)
        watcher.add_done_callback(self._tasks.discard)
        while True:
            seen = self.seen("leader")
            try:
                await self._tick()
            except EtcdError as e:
                log.warning("etcd: %s", e)
                self._step_down("etcd unreachable")  # unsure we still hold them
            # A leader key that expired or was given up: campaign now, not
            # at the next renewal.
            await self.wait_change("leader", seen, every)

    # -- the watch ----------------------------------------------------------------
    def seen(self, what: str) -> int:
        return self._seq[what]

    async def wait_change(self, what: str, seen: int, at_most: float | None = None) -> None:
        if at_most is None:
            at_most = RESYNC_S if self.watching else POLL_S
        deadline = asyncio.get_running_loop().time() + at_most
        while self._seq[what] == seen:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _changed(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            if kind in self._seq:
                self._seq[kind] += 1
        self._wake.set()
        self._wake = asyncio.Event()

    async def _watch(self) -> None:
        """Follow the prefix for the life of the process; reconnect when it breaks."""
        root = self.cfg.prefix.rstrip("/") + "/"
        while True:
            try:
                async for keys in self.client.watch(root):
                    if keys is None:  # (re)started: whatever changed meanwhile, read it
                        self.watching = True
                        self._changed(KINDS)
                    else:
                        first = {k[len(root) :].split("/", 1)[0] for k in keys}
                        self._changed({SAME_AS.get(f, f) for f in first})
            except EtcdError as e:
                log.warning("etcd watch: %s; polling until it is back", e)
            self.watching = False
            self._changed(KINDS)  # waiters fall back to polling now
            await asyncio.sleep(WATCH_RETRY_S)

    async def _tick(self) -> None:
        if self.lease is None or not await self.client.keepalive(self.lease):
            self._step_down("lease lost")
            self.lease = await self.client.grant(self.cfg.lease_ttl_s)
            self._leased.set()
        await self._balance()
        if self.is_leader():
            await self._take_over_orphans()

    async def _balance(self) -> None:
        """Lead a fair share of the groups.

        Every live process has a ``members/<id>`` key on its lease. A process
        takes a group nobody leads while it leads fewer than its share
        (groups / members, rounded up), or any group left without a leader
        for two of its ticks (a member that cannot take it); a process over
        its share while another is under gives one group up, and the watch
        hands it to a process under its share at once. So leadership spreads
        over the replicas, and one dead process takes only its own groups'
        leaders with it.
        """
        assert self.lease is not None
        members_at = self._key("members") + "/"
        members = {k[len(members_at) :] for k in await self.client.get_prefix(members_at)}
        if self.me not in members:
            await self.client.put(self._key("members", self.me), True, self.lease)
            members.add(self.me)
        leaders_at = self._key("leader") + "/"
        holders = {k[len(leaders_at) :]: json.loads(v)
                   for k, v in (await self.client.get_prefix(leaders_at)).items()}  # fmt: skip
        groups = sorted(self._leads)
        share = -(-len(groups) // len(members))
        mine = [g for g in groups if holders.get(g) == self.me]
        for group in groups:
            event = self._leads[group]
            if group in holders:
                self._unled.pop(group, None)
                if holders[group] == self.me and not event.is_set():
                    self._lead(group)  # new, or still ours after an etcd error
                elif holders[group] != self.me and event.is_set():
                    event.clear()  # not ours any more (the key went, another took it)
                continue
            self._unled[group] = self._unled.get(group, 0) + 1
            if (len(mine) < share or self._unled[group] > 2) and await self._campaign(group):
                mine.append(group)
                self._lead(group)
        if not any(e.is_set() for e in self._leads.values()):
            self._leader.clear()
        counts = [sum(1 for h in holders.values() if h == m) for m in members]
        if len(mine) > share and min(counts) < share:
            group = mine[-1]
            self._leads[group].clear()  # stop starting its rounds before the key goes
            if await self.client.delete_if(self._key("leader", group), self.me):
                log.info("%s hands group %s over (it leads %d, its share is %d)",
                         self.me, group, len(mine), share)  # fmt: skip

    def _lead(self, group: str) -> None:
        log.info("%s leads recovery of group %s (etcd lease %s)", self.me, group, self.lease)
        self._leads[group].set()
        self._leader.set()

    async def _campaign(self, group: str) -> bool:
        """Take the group's leader key."""
        assert self.lease is not None
        return await self.client.create(self._key("leader", group), self.me, self.lease)

    async def close(self) -> None:
        self._step_down("stopping", logging.INFO)
        for task in self._tasks:
            task.cancel()
        if self.lease is not None:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self.lease)  # leadership moves at once
        await self.client.close()

    # -- rounds -------------------------------------------------------------------
    async def run_round(self, spec: RoundSpec, trigger: str) -> RoundReport:
        await self._leased.wait()
        key = self._key("rounds", spec.group)
        while True:
            record, revision = await self.client.get(key)
            if record is not None and record["state"] != "done":
                if not _spec(record).same_work(spec):
                    raise RoundInProgress(
                        f"round {record['round_id']} ({record['instruction']}) is in progress "
                        f"for group {spec.group}; wait for it to end, then ask again",
                        record["round_id"], record["instruction"],
                    )  # fmt: skip
                return await self._await_done(key, record["round_id"])
            round_id = uuid.uuid4().hex
            fresh = {**_record(spec, round_id, trigger), "state": "waiting", "owner": self.me}
            owner = (key + "/owner", self.me, self.lease)
            if await self.client.create(key, fresh, also=[owner], mod_revision=revision):
                return await self._drive(key, fresh, already_sent=False)
            # Someone else created one first: look again (join or 409).

    async def _drive(self, key: str, record: dict[str, Any], already_sent: bool) -> RoundReport:
        assert self.recovery is not None

        async def sent() -> None:  # durable before the first POST goes out
            await self.client.put(key, {**record, "state": "sent"})

        report = await self.recovery.run(
            _spec(record), record["trigger"], record["round_id"], sent, already_sent
        )
        done = {**record, "state": "done", "report": report.as_dict()}
        for attempt in range(10):  # the report must land, or joiners wait forever
            try:
                await self.client.put(key, done)
                await self.client.delete(key + "/owner")
                break
            except EtcdError as e:
                log.warning("round %s: report not stored yet (%s)", record["round_id"], e)
                await asyncio.sleep(0.2 * (attempt + 1))
        return report

    async def _await_done(self, key: str, round_id: str) -> RoundReport:
        while True:
            seen = self.seen("rounds")
            record, _ = await self.client.get(key)
            if record is None or record["round_id"] != round_id:
                raise EtcdError(f"round {round_id} vanished from etcd")
            if record["state"] == "done":
                return _report(record["report"])
            await self.wait_change("rounds", seen)

    async def _take_over_orphans(self) -> None:
        keys = await self.client.get_prefix(self._key("rounds") + "/")
        for key, raw in keys.items():
            if key.endswith("/owner") or key + "/owner" in keys:
                continue
            record = json.loads(raw)
            if record.get("state") == "done" or record["round_id"] in self._taken:
                continue
            if not self.is_leader(record["group"]):
                continue  # the group's own leader takes it over
            owner = self.me
            if not await self.client.create(key + "/owner", owner, self.lease):
                continue
            self._taken.add(record["round_id"])
            sent = record["state"] == "sent"
            log.warning("round %s of group %s lost its driver (%s); %s takes it over%s",
                        record["round_id"], record["group"], record.get("owner"), self.me,
                        ": watching only, it was sent" if sent else "")  # fmt: skip
            task = asyncio.create_task(self._drive(key, {**record, "owner": owner}, sent))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def wait_round_idle(self, group: str) -> None:
        key = self._key("rounds", group)
        while True:
            seen = self.seen("rounds")
            record, _ = await self.client.get(key)
            if record is None or record["state"] == "done":
                return
            await self.wait_change("rounds", seen)

    async def rounds(self) -> list[dict[str, Any]]:
        keys = await self.client.get_prefix(self._key("rounds") + "/")
        out = []
        for key, raw in sorted(keys.items()):
            if key.endswith("/owner"):
                continue
            record = json.loads(raw)
            out.append({
                "group": record["group"], "active": record["state"] != "done",
                "state": record["state"], "trigger": record["trigger"],
                "params": record["params"], "targets": record["targets"],
                "driver": keys.get(key + "/owner") and json.loads(keys[key + "/owner"]),
                "report": record.get("report") or {"round_id": record["round_id"],
                                                   "instruction": record["instruction"],
                                                   "outcome": "running"},
            })  # fmt: skip
        return out

    # -- weights ------------------------------------------------------------------
    async def set_weight(self, rank: str, weight: int) -> bool:
        await self.client.put(self._key("weights", rank), weight)
        return True

    async def weights(self) -> dict[str, int] | None:
        prefix = self._key("weights") + "/"
        found = await self.client.get_prefix(prefix)
        return {k[len(prefix) :]: int(json.loads(v)) for k, v in found.items()}

    async def set_removed(self, rank: str) -> bool:
        await self.client.put(self._key("removed", rank), True)
        return True

    async def removed(self) -> set[str] | None:
        prefix = self._key("removed") + "/"
        return {k[len(prefix) :] for k in await self.client.get_prefix(prefix)}


def _record(spec: RoundSpec, round_id: str, trigger: str) -> dict[str, Any]:
    return {"group": spec.group, "round_id": round_id, "instruction": spec.instruction,
            "params": spec.params, "targets": spec.targets, "trigger": trigger,
            "wait_unhealthy_s": spec.wait_unhealthy_s, "recover_s": spec.recover_s}  # fmt: skip


def _spec(record: dict[str, Any]) -> RoundSpec:
    r = record
    return RoundSpec(r["group"], r["instruction"], r["params"], r["targets"],
                     r["wait_unhealthy_s"], r["recover_s"])  # fmt: skip


def _report(data: dict[str, Any]) -> RoundReport:
    ranks = [RankReport(**r) for r in data.get("ranks", [])]
    report = RoundReport(**{k: v for k, v in data.items() if k != "ranks"})
    report.ranks = ranks
    return report
