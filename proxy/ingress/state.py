"""The app's typed state keys, shared by every module that reads them.

The types are annotations only (``TYPE_CHECKING``): a key is a name, and
importing this module must not import every component of the app, or each
handler that reads one key would sit above all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    import ssl
    from pathlib import Path

    from proxy.control.ranks import RankTable
    from proxy.control.recovery import Recovery
    from proxy.core.settings import Settings
    from proxy.dataplane.relay import Relay
    from proxy.ingress.limits import RequestLimit
    from proxy.telemetry.accesslog import AccessLog
    from proxy.telemetry.metrics import Metrics
    from proxy.telemetry.tracing import Tracing
    from proxy.upstream import Upstream
    from proxy.upstream.bounded import Bound

# None: the access log is off.
ACCESS_LOG: web.AppKey[AccessLog | None] = web.AppKey("access_log")
# None: tracing is off.
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")
SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
TABLE: web.AppKey[RankTable] = web.AppKey("table")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
# Every connection to the ranks (the relay's and the side requests').
UPSTREAM: web.AppKey[Upstream] = web.AppKey("upstream")
RELAY: web.AppKey[Relay] = web.AppKey("relay")
RECOVERY: web.AppKey[Recovery] = web.AppKey("recovery")
# How much of a rank's /v1/models is read (proxy.control.models).
MODEL_LISTS: web.AppKey[Bound] = web.AppKey("model_lists")
CONFIG_PATH: web.AppKey[Path] = web.AppKey("config_path")
LIMIT: web.AppKey[RequestLimit] = web.AppKey("limit")
# The HTTPS listener's context, reloaded in place with the config (SIGHUP).
LISTENER_TLS: web.AppKey[ssl.SSLContext] = web.AppKey("listener_tls")
