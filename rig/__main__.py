"""``python -m rig``: run N local vLLM CPU ranks until Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
from pathlib import Path

from rig.launcher import Rig, RigConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--base-port", type=int, default=8400)
    parser.add_argument("--model-dir", type=Path, default=Path(".rig/tiny-moe"))
    parser.add_argument("--fault-inject", help="e.g. 'rank=1;steps=300,900'")
    parser.add_argument(
        "--collective-timeout", type=int, default=10,
        help="seconds a faulted rank's peers wait in a collective before turning unhealthy",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = RigConfig(
        ranks=args.ranks,
        base_port=args.base_port,
        model_dir=args.model_dir,
        fault_inject=args.fault_inject,
        collective_timeout_s=args.collective_timeout,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Rig(cfg):
        print("ranks ready:", ", ".join(cfg.url(r) for r in range(cfg.ranks)), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()


if __name__ == "__main__":
    main()
