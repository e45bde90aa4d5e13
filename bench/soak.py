"""Real-engine soak: faults injected while streams run, every answer checked.

``python -m bench.soak [--faults 20] [--modes abort,resume]`` starts the rig
(2 vLLM CPU ranks, float32 tiny MoE) and the proxy in front of it, per mode:

* ``abort``: vLLM's own behaviour, in-flight requests end with an abort chunk
  and the proxy continues them on a fresh request;
* ``resume``: ``FTPROXY_RESUME_AFTER_RECOVERY=1``, the engine pauses its
  requests and resumes them after recovery.

Each round arms one fault on rank 1 a random number of DP steps ahead, sends
12 requests through the proxy (completions and chat, streamed and whole,
greedy, 8 of them asking for token ids), waits until both ranks are
unhealthy, sends ``retry`` to both as an operator would, and compares every
answer with the fault-free oracle (bench/oracle.py). The table is printed by
bench/soak_report.py; the raw results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.oracle import NEAR_TIE, Reference, first_difference, references
from engine_ext.rig.launcher import SERVED_MODEL, Rig, RigConfig

log = logging.getLogger("ftproxy.soak")

MAX_TOKENS = 100
STREAM_TIMEOUT_S = 240.0  # an answer not finished by then is a hang
HOLD = {"keepalive_s": 1.0, "stall_s": 30.0, "timeout_s": 120.0}
PROMPTS = ["the proxy", "café au lait, naïve", "ranks and steps", "données → 数据", "streams"]


def soak_requests() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(12):
        body: dict[str, Any] = {
            "model": SERVED_MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": i % 4 < 2,
        }  # fmt: skip
        if i % 3 != 2:
            body["return_token_ids"] = True
        prompt = f"Soak {i}: {PROMPTS[i % len(PROMPTS)]}"
        if i % 2:
            out.append(
                (
                    "/v1/chat/completions",
                    {**body, "messages": [{"role": "user", "content": prompt}]},
                )
            )
        else:
            out.append(("/v1/completions", {**body, "prompt": prompt}))
    return out


@dataclass
class Answer:
    status: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # wall clock of each data event
    hung: bool = False


async def ask(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Answer:
    ans = Answer()
    chat = path.endswith("/chat/completions")
    try:
        async with http.post(url + path, json=body) as r:
            ans.status = r.status
            if not body.get("stream"):
                data = await r.json(content_type=None)
                ans.arrivals.append(time.time())
                _take(ans, data, chat, whole=True)
                return ans
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ans.arrivals.append(time.time())
                    _take(ans, json.loads(line[6:]), chat, whole=False)
    except TimeoutError:
        ans.hung = True
    except (aiohttp.ClientError, ValueError) as exc:
        ans.errors.append(repr(exc))
    return ans


def _take(ans: Answer, data: dict[str, Any], chat: bool, whole: bool) -> None:
    if "error" in data:
        ans.errors.append(data["error"])
    for c in data.get("choices") or []:
        ans.ids.extend(c.get("token_ids") or [])
        if chat:
            part = (c.get("message") if whole else c.get("delta")) or {}
            ans.text += part.get("content") or ""
        else:
            ans.text += c.get("text") or ""
        if c.get("finish_reason"):
            ans.finishes.append(c["finish_reason"])


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


def check(
    path: str, body: dict[str, Any], ref: Reference, ans: Answer, retry_at: float | None
) -> dict[str, Any]:
    """One answer against its reference: what the table counts."""
    wants_ids = bool(body.get("return_token_ids"))
    ops = difflib.SequenceMatcher(a=ref.ids, b=ans.ids, autojunk=False).get_opcodes()
    lost = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag in ("delete", "replace"))
    extra = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag in ("insert", "replace"))
    error = ans.status != 200 or bool(ans.errors) or ans.finishes != ["length"]
    diff_id = first_difference(ref.ids, ans.ids) if wants_ids else None
    gaps = [b - a for a, b in zip(ans.arrivals, ans.arrivals[1:], strict=False)]
    resumed = [t - retry_at for t in ans.arrivals if retry_at is not None and t > retry_at]
    return {
        "path": path, "stream": bool(body.get("stream")), "ids": wants_ids,
        "id_exact": ans.ids == ref.ids if wants_ids else None,
        "text_exact": ans.text == ref.text,
        "lost": lost if wants_ids else 0, "extra": extra if wants_ids else 0,
        "error": error, "hung": ans.hung,
        "detail": {"status": ans.status, "errors": ans.errors[:2], "finishes": ans.finishes},
        "first_diff_id": diff_id,
        "ref_margin_at_diff": ref.margin_at(diff_id) if diff_id is not None else None,
        "first_diff_char": (at := first_difference(ref.text, ans.text)),
        # what a difference looks like, for the report (None when exact)
        "texts": None if at is None else {"reference": ref.text[max(0, at - 20) : at + 40],
                                          "answer": ans.text[max(0, at - 20) : at + 40]},
        "max_gap_s": max(gaps, default=0.0) if body.get("stream") else None,
        "retry_to_resumed_s": resumed[0] if resumed and body.get("stream") else None,
    }  # fmt: skip


def arm(trigger: Path, steps: int) -> None:
    """Rank 1 faults ``steps`` DP steps from now (engine_ext/fault_inject)."""
    Path(str(trigger) + ".fired").unlink(missing_ok=True)
    trigger.write_text(str(steps))


def fired_at(fired_file: Path) -> float | None:
    return float(fired_file.read_text()) if fired_file.exists() else None


async def one_round(
    proxy_url: str, urls: list[str], trigger: Path, refs: list[Reference],
    reqs: list[tuple[str, dict[str, Any]]], steps: int,
) -> Round:  # fmt: skip
    fired_file = Path(str(trigger) + ".fired")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        unplanned = await heal(http, urls)
        arm(trigger, steps)
        timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as clients:
            tasks = [asyncio.create_task(ask(clients, proxy_url, p, b)) for p, b in reqs]
            fired = await wait_statuses(http, urls, "unhealthy", 90)
            retry_at = healthy_at = None
            if fired:
                retry_at = time.time()
                await retry(http, urls)
                if await wait_statuses(http, urls, "healthy", 60):
                    healthy_at = time.time()
            answers = await asyncio.gather(*tasks)
    fault_time = fired_at(fired_file)
    streams = [
        check(p, b, r, a, retry_at) for (p, b), r, a in zip(reqs, refs, answers, strict=True)
    ]
    return Round(
        fault_at_steps=steps, unplanned_faults=unplanned, fired=fired,
        recovered=healthy_at is not None,
        fault_to_healthy_s=healthy_at - fault_time if healthy_at and fault_time else None,
        retry_to_resumed_s=[t for s in streams if (t := s["retry_to_resumed_s"]) is not None],
        holds_s=[s["max_gap_s"] for s in streams if s["max_gap_s"] is not None],
        streams=streams,
    )  # fmt: skip


async def run_mode(cfg: RigConfig, trigger: Path, faults: int, seed: int = 0) -> list[Round]:
    """``faults`` rounds against a running rig (its proxy is started here)."""
    from proxy.server import start
    from proxy.settings import Settings
    from proxy.state import TABLE

    urls = [cfg.url(r) for r in range(cfg.ranks)]
    reqs = soak_requests()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        unplanned = await heal(http, urls)
    refs = await references(urls[0], reqs)
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
    rounds = []
    try:
        assert await table.wait_for(lambda: all(r.routable for r in table), 20.0)
        for n in range(faults):
            steps = rng.randint(1, MAX_TOKENS - 10)
            rnd = await one_round(running.url, urls, trigger, refs, reqs, steps)
            bad = [s for s in rnd.streams if s["error"] or s["hung"] or not s["text_exact"]]
            log.info(
                "round %d/%d: fault at step %d, %d of 12 not exact", n + 1, faults, steps, len(bad)
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
        resume_after_recovery=resume,
    )  # fmt: skip
    return cfg, trigger


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
