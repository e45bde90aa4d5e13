"""Which rank endpoints clients may call through the proxy (``routing.forward``).

Entries are ``"METHOD /path"``; the config refuses an unsafe one at load, so
the route table only ever holds serving endpoints. Rank control, health and
metrics paths, and vLLM's development-mode control endpoints, are never
forwarded, whatever the config says. Pure: settings read it at load.
"""

from __future__ import annotations

import re

# The serving endpoints a client may use, as "METHOD /path".
DEFAULT_FORWARD = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/embeddings",
    "POST /v1/score",
    "POST /v1/rerank",
    "POST /tokenize",
    "POST /detokenize",
)

# Rank endpoints that must never be reachable through the data plane: FT control,
# health and metrics, and vLLM's development-mode control endpoints.
FORBIDDEN_PREFIXES = (
    "/fault_tolerance",
    "/health",
    "/metrics",
    "/admin",
    "/ping",
    "/load",
    "/version",
    "/server_info",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/pause",
    "/resume",
)
FORWARD_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
_CONFIG_PATH = re.compile(r"(?:/[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*)+")


def parse_forward(entry: str) -> tuple[str, str]:
    """``"POST /v1/completions"`` -> ``("POST", "/v1/completions")``; ValueError if unsafe."""
    method, _, path = entry.strip().partition(" ")
    path = path.strip()
    if method not in FORWARD_METHODS:
        raise ValueError(f"{entry!r}: method must be one of {', '.join(sorted(FORWARD_METHODS))}")
    if not _CONFIG_PATH.fullmatch(path):
        raise ValueError(f"{entry!r}: path must be /segments of letters, digits, _ - .")
    if any(path == p or path.startswith(p + "/") for p in FORBIDDEN_PREFIXES):
        raise ValueError(f"{entry!r}: a rank control, health or metrics path is never forwarded")
    if path == "/v1/models":
        raise ValueError(f"{entry!r}: /v1/models is answered by the proxy itself")
    return method, path
