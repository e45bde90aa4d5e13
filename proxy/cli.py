"""``ft-proxy``: command line entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.settings import ConfigError, load_settings

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ft-proxy", description="Fault-tolerance-aware vLLM proxy")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=Path, default=Path("config/proxy.yaml"))
    return p


def _run(coro_factory: object) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional off Linux/macOS
        pass
    asyncio.run(coro_factory)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"ft-proxy: invalid configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    from proxy.server import serve_forever

    with contextlib.suppress(KeyboardInterrupt):
        _run(serve_forever(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
