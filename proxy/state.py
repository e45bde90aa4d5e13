"""The app's typed state keys, shared by every module that reads them."""

from __future__ import annotations

import ssl
from pathlib import Path

from aiohttp import web

from proxy.accesslog import AccessLog
from proxy.bounded import Bound
from proxy.limits import RequestLimit
from proxy.metrics import Metrics
from proxy.ranks import RankTable
from proxy.recovery import Recovery
from proxy.relay import Relay
from proxy.settings import Settings
from proxy.tracing import Tracing
from proxy.upstream import Upstream

# None: the access log is off.
ACCESS_LOG: web.AppKey[AccessLog | None] = web.AppKey("access_log")
# None: tracing is off.
TRACING: web.AppKey[Tracing | None] = web.AppKey("tracing")
SETTINGS = web.AppKey("settings", Settings)
TABLE = web.AppKey("table", RankTable)
METRICS = web.AppKey("metrics", Metrics)
# Every connection to the ranks (the relay's and the side requests').
UPSTREAM = web.AppKey("upstream", Upstream)
RELAY = web.AppKey("relay", Relay)
RECOVERY = web.AppKey("recovery", Recovery)
# How much of a rank's /v1/models is read (proxy.models).
MODEL_LISTS = web.AppKey("model_lists", Bound)
CONFIG_PATH = web.AppKey("config_path", Path)
LIMIT = web.AppKey("limit", RequestLimit)
# The HTTPS listener's context, reloaded in place with the config (SIGHUP).
LISTENER_TLS = web.AppKey("listener_tls", ssl.SSLContext)
