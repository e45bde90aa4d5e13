"""``python -m rig.demo``: two real vLLM CPU ranks behind ft-proxy.

Starts the rig, then the proxy with ``config/proxy.yaml``, prints the URL and a
request to paste, and runs until Ctrl-C; then stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path

from rig.launcher import SERVED_MODEL, Rig, RigConfig

CONFIG = Path("config/proxy.yaml")


def banner(url: str) -> str:
    return f"""
ft-proxy is up at {url}, in front of 2 real vLLM CPU ranks ({SERVED_MODEL}).
Try:

  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{SERVED_MODEL}", "prompt": "The proxy", "max_tokens": 16}}'

Rank table: curl -s {url}/metrics | grep ftproxy_rank_status
Ctrl-C stops the proxy and the ranks.
"""


async def _serve() -> None:
    from proxy.core.settings import load_settings
    from proxy.server import serve_forever

    settings = load_settings(CONFIG)
    url = f"http://{settings.listen.host}:{settings.listen.port}"
    task = asyncio.create_task(serve_forever(settings))
    await asyncio.sleep(1.0)
    if not task.done():
        print(banner(url), flush=True)
    await task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault-inject", help="fault rank 1 at DP steps, e.g. 'rank=1;steps=400'")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print("starting 2 vLLM CPU ranks (about a minute; logs in .rig/logs) ...", flush=True)
    # 5 s: on a quiet machine the peer of a faulted rank notices quickly.
    cfg = RigConfig(ranks=2, fault_inject=args.fault_inject, collective_timeout_s=5)
    with Rig(cfg), contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve())
    sys.exit(0)


if __name__ == "__main__":
    main()
