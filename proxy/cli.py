"""``ft-proxy``: command line entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from proxy.core.settings import CannotListen, ConfigError, Settings, load_settings
from proxy.telemetry import logformat

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ft-proxy", description="Fault-tolerance-aware vLLM proxy")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=Path, default=Path("config/proxy.yaml"))
    serve.add_argument("--workers", type=int, help="worker processes (default: config workers)")
    for name, text in (("status", "live table of ranks"), ("retry", "run a retry round")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy")
        cmd.add_argument("--token", help="admin token (default: $FTPROXY_ADMIN__TOKEN)")
        cmd.add_argument("--ca-file", type=Path, help="CA of an https:// proxy's certificate")
        if name == "status":
            cmd.add_argument(
                "--once",
                action="store_true",
                help="print once and exit (always so when the output is not a terminal)",
            )
        else:
            cmd.add_argument("group")
            cmd.add_argument("--wait", type=float, default=30.0, help="precondition wait, s")
            cmd.add_argument("--recover", type=float, default=120.0, help="round deadline, s")
    return p


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional off Linux/macOS
        pass
    asyncio.run(coro)


def _admin(args: argparse.Namespace) -> int:
    import aiohttp

    from proxy import admin_cli

    try:
        client = admin_cli.AdminClient(args.url, args.token, args.ca_file)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        print(f"ft-proxy: cannot use --ca-file {args.ca_file}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "status":
        coro = admin_cli.status(client, args.once)
    else:
        coro = admin_cli.retry(client, args.group, args.wait, args.recover)
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        return 0
    except TimeoutError:  # an OSError: said first
        print(f"ft-proxy: {args.url} did not answer in time", file=sys.stderr)
        return 1
    except (OSError, aiohttp.ClientError) as e:  # a refused connection, a reset, a bad URL
        print(f"ft-proxy: cannot reach {args.url}: {e!r}", file=sys.stderr)
        return 1
    except admin_cli.AdminError as e:
        print(f"ft-proxy: {args.url}: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:  # a table or report without a field it has
        print(f"ft-proxy: {args.url}: an answer of another shape ({e!r})", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("status", "retry"):
        return _admin(args)
    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"ft-proxy: invalid configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    logformat.configure(settings.logging.format, settings.log_level)
    workers = args.workers if args.workers is not None else settings.workers
    if workers < 1:
        print("ft-proxy: --workers must be at least 1", file=sys.stderr)
        return EXIT_CONFIG
    if workers > 1:
        from proxy import supervisor

        try:
            return supervisor.serve(settings, args.config, workers, _worker)
        except CannotListen as e:
            print(f"ft-proxy: {e}", file=sys.stderr)
            return 1
    from proxy.server import serve_forever

    try:
        with contextlib.suppress(KeyboardInterrupt):
            _run(serve_forever(settings, args.config))
    except CannotListen as e:
        print(f"ft-proxy: {e}", file=sys.stderr)
        return 1
    return 0


def _worker(settings: Settings, config_path: Path | None, sock: socket.socket, run: Path) -> int:
    """One forked worker of ``--workers N``: the app on the shared socket."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    from proxy.control.coordination.backend import for_settings
    from proxy.server import serve_forever

    _run(serve_forever(settings, config_path, sock, for_settings(settings, run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
