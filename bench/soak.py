"""Real-engine soak: faults injected while streams run, every answer checked.

``python -m bench.soak [--faults 20] [--modes abort,resume]`` starts the rig
(2 vLLM CPU ranks, float32 tiny MoE, each engine recording its requests) and
the proxy in front of it, per mode:

* ``abort``: vLLM's own behaviour, in-flight requests end with an abort chunk
  and the proxy continues them on a fresh request;
* ``resume``: ``FTPROXY_RESUME_AFTER_RECOVERY=1``, the engine pauses its
  requests and resumes them after recovery.

Each round arms one fault on rank 1 a random number of DP steps ahead, sends
20 requests through the proxy, waits until both ranks are unhealthy, sends
``retry`` to both as an operator would, and checks every answer:

* 12 greedy (completions and chat, streamed and whole, 8 asking for token
  ids): against the fault-free reference (bench/oracle.py), and for
  consistency with what the engines did (bench/consistency.py);
* 8 sampled (temperature 0.7, no seed; completions and chat, streamed and
  whole, half asking for token ids, streams asking for usage): a fault-free
  run cannot reproduce them, so only for consistency: the continuations'
  prompts are the prompt plus ids the client had, the client's ids are the
  engine's, its text is their detokenization, one finish reason, the count
  and usage right, no error.

The table is printed by bench/soak_report.py; the raw results go to
``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import consistency
from bench.consistency import read_engine_log, request_key
from bench.oracle import NEAR_TIE, Reference, references
from bench.soak_answers import (
    MAX_TOKENS,
    Answer,
    ask,
    check,
    is_defect,
    is_sampled,
    soak_requests,
)
from rig.launcher import SERVED_MODEL, Rig, RigConfig
from rig.model import VOCAB_SIZE

log = logging.getLogger("ftproxy.soak")

STREAM_TIMEOUT_S = 240.0  # an answer not finished by then is a hang
HOLD = {"keepalive_s": 1.0, "stall_s": 30.0, "timeout_s": 120.0}


@dataclass
class Round:
    fault_at_steps: int
    unplanned_faults: int  # found (and retried) before this round's fault was armed
    fired: bool
    recovered: bool
    fault_to_healthy_s: float | None
    retry_to_resumed_s: list[float]
    holds_s: list[float]
    streams: list[dict[str, Any]]


async def statuses(http: aiohttp.ClientSession, urls: list[str]) -> list[str]:
    out = []
    for url in urls:
        try:
            async with http.get(url + "/fault_tolerance/status") as r:
                out.append((await r.json())["engines"][0]["status"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            out.append("unreachable")
    return out


async def wait_statuses(
    http: aiohttp.ClientSession, urls: list[str], want: str, timeout_s: float
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await statuses(http, urls) == [want] * len(urls):
            return True
        await asyncio.sleep(0.2)
    return False


async def retry(http: aiohttp.ClientSession, urls: list[str]) -> None:
    body = {"instruction": "retry", "params": {}}
    for url in urls:
        async with http.post(url + "/fault_tolerance/apply", json=body) as r:
            await r.read()


async def heal(http: aiohttp.ClientSession, urls: list[str]) -> int:
    """Bring a group back that faulted outside a round (or fail loudly);
    returns how many retries that took: faults nobody injected."""
    deadline = time.monotonic() + 90
    retries = 0
    while (now := await statuses(http, urls)) != ["healthy"] * len(urls):
        if now == ["unhealthy"] * len(urls):
            await retry(http, urls)
            retries += 1
            await wait_statuses(http, urls, "healthy", 30)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rig not healthy: {now}")
        await asyncio.sleep(1.0)
    return retries


@dataclass
class Soak:
    """What every round of one mode shares."""

    proxy_url: str
    cfg: RigConfig
    trigger: Path
    run: str  # in every request id of this run: records of earlier runs are not read
    reqs: list[tuple[str, dict[str, Any]]]
    refs: list[Reference | None]  # None: sampled
    special: frozenset[int]

    @property
    def urls(self) -> list[str]:
        return [self.cfg.url(r) for r in range(self.cfg.ranks)]

    def logs(self) -> list[Path]:
        return [self.cfg.request_log_path(r) for r in range(self.cfg.ranks)]


def detokenizer(http: aiohttp.ClientSession, url: str) -> consistency.Detokenize:
    """Ids to text by the rank's ``/detokenize``."""

    async def detokenize(ids: list[int]) -> str:
        async with http.post(url + "/detokenize", json={"model": SERVED_MODEL, "tokens": ids}) as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"/detokenize answered {r.status}: {data}")
            return str(data["prompt"])

    return detokenize


async def judge(
    soak: Soak, round_no: int, answers: list[Answer], retry_at: float | None
) -> list[dict[str, Any]]:
    """Every answer of a round: against its reference, and for consistency
    with what the engines recorded."""
    engine = read_engine_log(soak.logs())
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        detokenize = detokenizer(http, soak.urls[0])
        for i, ((path, body), ref, ans) in enumerate(
            zip(soak.reqs, soak.refs, answers, strict=True)
        ):
            stream = check(path, body, ref, ans, retry_at)
            mine = engine.get(request_key(soak.run, round_no, i), [])
            found = await consistency.check(
                ans.seen(body), mine, MAX_TOKENS, detokenize, soak.special, check_text=ref is None
            )
            if ref is None and body.get("return_token_ids"):
                stream["lost"], stream["extra"] = found["lost"], found["extra"]
            stream.update(consistency=found, problems=found["problems"])
            stream["defect"] = is_defect(stream)
            out.append(stream)
    return out


def arm(trigger: Path, steps: int) -> None:
    """Rank 1 faults ``steps`` DP steps from now (engine_ext/fault_inject)."""
    Path(str(trigger) + ".fired").unlink(missing_ok=True)
    trigger.write_text(str(steps))


def fired_at(fired_file: Path) -> float | None:
    return float(fired_file.read_text()) if fired_file.exists() else None


async def one_round(soak: Soak, round_no: int, steps: int) -> Round:
    fired_file = Path(str(soak.trigger) + ".fired")
    urls = soak.urls
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        unplanned = await heal(http, urls)
        arm(soak.trigger, steps)
        timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as clients:
            tasks = [
                asyncio.create_task(
                    ask(clients, soak.proxy_url, p, b, request_key(soak.run, round_no, i))
                )
                for i, (p, b) in enumerate(soak.reqs)
            ]
            fired = await wait_statuses(http, urls, "unhealthy", 90)
            retry_at = healthy_at = None
            if fired:
                retry_at = time.time()
                await retry(http, urls)
                if await wait_statuses(http, urls, "healthy", 60):
                    healthy_at = time.time()
            answers = await asyncio.gather(*tasks)
    fault_time = fired_at(fired_file)
    streams = await judge(soak, round_no, answers, retry_at)
    return Round(
        fault_at_steps=steps, unplanned_faults=unplanned, fired=fired,
        recovered=healthy_at is not None,
        fault_to_healthy_s=healthy_at - fault_time if healthy_at and fault_time else None,
        retry_to_resumed_s=[t for s in streams if (t := s["retry_to_resumed_s"]) is not None],
        holds_s=[s["max_gap_s"] for s in streams if s["max_gap_s"] is not None],
        streams=streams,
    )  # fmt: skip


async def run_mode(cfg: RigConfig, trigger: Path, faults: int, seed: int = 0) -> list[Round]:
    """``faults`` rounds against a running rig whose engines record their
    requests (``RigConfig.request_log``); its proxy is started here."""
    from proxy.core.settings import Settings
    from proxy.ingress.state import TABLE
    from proxy.server import start

    urls = [cfg.url(r) for r in range(cfg.ranks)]
    reqs = soak_requests(consistency.ascii_ids(cfg.model_dir), VOCAB_SIZE)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        unplanned = await heal(http, urls)
    greedy = await references(urls[0], [r for r in reqs if not is_sampled(r[1])])
    found = iter(greedy)
    refs = [None if is_sampled(b) else next(found) for _, b in reqs]
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "soak", "ranks": [
            {"name": f"r{r}", "url": cfg.url(r), "status_feed": cfg.status_feed(r)}
            for r in range(cfg.ranks)
        ]}],
        timeouts={"queue_s": 90.0}, hold=HOLD,
    )  # fmt: skip
    running = await start(settings)
    table = running.app[TABLE]
    rng = random.Random(seed)
    soak = Soak(
        running.url,
        cfg,
        trigger,
        os.urandom(3).hex(),
        reqs,
        refs,
        consistency.special_ids(cfg.model_dir),
    )
    rounds = []
    try:
        assert await table.wait_for(lambda: all(r.routable for r in table), 20.0)
        for n in range(faults):
            steps = rng.randint(1, MAX_TOKENS - 10)
            rnd = await one_round(soak, n + 1, steps)
            bad = sum(s["defect"] for s in rnd.streams)
            log.info(
                "round %d/%d: fault at step %d, %d of %d answers with a defect",
                n + 1,
                faults,
                steps,
                bad,
                len(rnd.streams),
            )
            rnd.unplanned_faults += unplanned
            unplanned = 0
            rounds.append(rnd)
    finally:
        await running.stop()
    return rounds


def rig_config(mode: str, work: Path) -> tuple[RigConfig, Path]:
    resume = mode == "resume"
    trigger = work / f"soak-trigger-{mode}"
    off = 10 if resume else 0
    cfg = RigConfig(
        ranks=2, base_port=8700 + off, pub_base_port=5700 + off, rpc_port=13700 + off,
        log_dir=work / f"logs-soak-{mode}", fault_inject=f"rank=1;trigger={trigger}",
        resume_after_recovery=resume, request_log=True,
    )  # fmt: skip
    return cfg.on_free_ports(), trigger


def main() -> None:
    from bench.soak_report import render

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--faults", type=int, default=20, help="faults per mode")
    parser.add_argument("--modes", default="abort,resume")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(".rig/soak.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("ftproxy.hold", "ftproxy.access"):  # one line per request and hold
        logging.getLogger(noisy).setLevel(logging.WARNING)
    work = Path(".rig").absolute()
    results: dict[str, Any] = {"faults_per_mode": args.faults, "modes": {}}
    for mode in args.modes.split(","):
        cfg, trigger = rig_config(mode, work)
        trigger.unlink(missing_ok=True)
        with Rig(cfg):
            rounds = asyncio.run(run_mode(cfg, trigger, args.faults, args.seed))
        results["modes"][mode] = [asdict(r) for r in rounds]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(f"(raw results: {args.out}; near tie below a top-2 margin of {NEAR_TIE})")


if __name__ == "__main__":
    main()
