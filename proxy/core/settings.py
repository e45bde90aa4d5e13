"""Settings: one YAML file, overridden by ``FTPROXY_*`` environment variables.

Loaded once by :func:`load_settings` and passed down; nothing reads the
environment or the file anywhere else. Nested keys use ``__`` in the
environment, e.g. ``FTPROXY_LISTEN__PORT=9000`` or ``FTPROXY_ADMIN__TOKEN``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from yarl import URL

from proxy.core.forward import DEFAULT_FORWARD, parse_forward
from proxy.core.tls import ListenerTLS, UpstreamTLS


class ConfigError(Exception):
    """The configuration cannot be used; the message names file and field."""


class CannotListen(Exception):
    """The configured listen address cannot be bound (in use, not this host's)."""

    def __init__(self, host: str, port: int, err: OSError) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {err.strerror or err}")


# With --workers N, each worker's supervisor (its pid, in the workers'
# environment): the process a worker's /admin/reload signals, and no other,
# should the worker outlive it and be another's child.
SUPERVISOR_ENV = "FTPROXY_SUPERVISOR_PID"

# Connections the kernel queues before the proxy accepts them, on one port or a
# workers' shared socket alike: asyncio's default (100) drops a burst's SYNs.
LISTEN_BACKLOG = 1024


class Listen(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tls: ListenerTLS | None = None  # set: HTTPS only on this port (proxy.core.tls)
    # Accepted and of no effect: every request takes the one connection
    # protocol (proxy.ingress.protocol), which the fast lane of old versions became.
    fast_lane: bool = True


class RankConfig(BaseModel):
    name: str = Field(min_length=1)
    url: str
    weight: int = Field(1, ge=0)
    # The rank's --data-parallel-rank (default: its position in the group);
    # scale_down names removed ranks by it.
    dp_rank: int | None = Field(None, ge=0)
    # ZMQ address of the engine plugin's status publisher, e.g. tcp://h:5570.
    status_feed: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        try:
            url = URL(v)
        except ValueError as e:
            raise ValueError(f"not a URL: {e}") from None
        if not url.host or url.query_string or url.fragment or url.user or url.password:
            raise ValueError("must be scheme://host[:port][/path], no query, fragment or user")
        return v.rstrip("/")


class AutoRecoveryConfig(BaseModel):
    """Retry a group on its own once all its ranks are unhealthy."""

    enabled: bool = False
    grace_s: float = Field(2.0, ge=0)  # whole group unhealthy this long: retry
    max_attempts: int = Field(3, ge=1)  # failed rounds before waiting for a human
    backoff_s: float = Field(5.0, ge=0)  # before attempt n+1: backoff_s * 2**(n-1)
    recover_s: float = Field(60.0, gt=0)  # a round's deadline to get healthy


class GroupConfig(BaseModel):
    name: str = Field(min_length=1)
    ranks: list[RankConfig] = Field(min_length=1)
    # The FT API its ranks speak (proxy.control.engines); auto: probed at start.
    engine: Literal["auto", "vllm-0.32", "vllm-v1", "sglang", "none"] = "auto"
    # Scrape each rank's /metrics for vLLM's per-engine ``vllm:engine_healthy``
    # gauge (PR #55915) as a status source beside the polls (proxy.control.healthmetric).
    engine_healthy: bool = False
    auto_recovery: AutoRecoveryConfig = AutoRecoveryConfig()


def _usable_secret(v: SecretStr | None) -> SecretStr | None:
    # An empty key would let an empty or missing Authorization header through.
    if v is not None:
        raw = v.get_secret_value()
        if not raw.strip():
            raise ValueError("must not be empty or whitespace")
        if any(c.isspace() or not c.isprintable() for c in raw):
            raise ValueError("must not contain whitespace or control characters")
    return v


class Admin(BaseModel):
    # Bearer token for /admin/*; unset: the admin plane is off (not open).
    token: SecretStr | None = None
    # Require a bearer token for GET /metrics: this one, or with
    # metrics_use_admin_token the admin token. Neither: /metrics is open.
    metrics_token: SecretStr | None = None
    metrics_use_admin_token: bool = False

    _secrets = field_validator("token", "metrics_token")(_usable_secret)

    @model_validator(mode="after")
    def _metrics_token_source(self) -> Admin:
        if self.metrics_use_admin_token and self.token is None:
            raise ValueError("metrics_use_admin_token needs admin.token")
        return self


class Timeouts(BaseModel):
    poll_interval_s: float = Field(0.25, gt=0, le=0.5)
    # A poll that takes longer fails and makes the rank unreachable: a hung API
    # server is noticed within poll_interval_s + poll_timeout_s. Not shorter by
    # default: a busy vLLM API server (both cores saturated, on the rig) answered
    # past 250 ms often enough to take healthy ranks, and their groups' streams,
    # out for a moment again and again.
    poll_timeout_s: float = Field(1.0, gt=0, le=5)
    connect_s: float = Field(2.0, gt=0)
    # No byte from a rank for this long: the request counts as lost (a stream
    # or whole answer is then held and continued, other answers fail over).
    read_s: float = Field(300.0, gt=0)
    # Idle upstream connections are closed after this long: below vLLM's
    # (uvicorn's) 5 s keep-alive, so the proxy never reuses one the rank closed.
    upstream_idle_s: float = Field(4.0, gt=0, lt=5)
    # How often ranks of a group with ``engine_healthy`` have /metrics scraped
    # (vLLM renders every metric for it: costlier than a status poll).
    engine_healthy_interval_s: float = Field(1.0, gt=0)
    # How long a new request waits for a healthy rank before 503.
    queue_s: float = Field(30.0, ge=0)
    # Missing heartbeats for this many publisher intervals: rank not routable.
    feed_silence_intervals: int = Field(3, ge=1)


class Hold(BaseModel):
    """Streams on hold through a fault (see proxy.dataplane.hold)."""

    keepalive_s: float = Field(2.0, gt=0)  # SSE comment interval while held
    stall_s: float = Field(30.0, gt=0)  # no event this long: hold
    timeout_s: float = Field(180.0, gt=0)  # held this long: error event, end
    # Per stream, in all (proxy.dataplane.budget): continuation requests sent, and time
    # on hold; beyond either, the stream ends with a budget_exceeded event.
    max_continuations: int = Field(8, ge=0)
    max_total_s: float = Field(300.0, gt=0)


class Liveness(BaseModel):
    """Passive ejection of a rank that answers nothing while it says healthy
    (proxy.control.liveness)."""

    enabled: bool = True
    # A rank with requests in flight and no sign of progress on any of them
    # (a first byte, a stream's event, an answer) for silence_s, plus
    # silence_per_mib_s per MiB of the requests still waiting for their first
    # byte (their prefill), is ejected while another rank answers.
    silence_s: float = Field(60.0, gt=0)
    silence_per_mib_s: float = Field(120.0, ge=0)
    # An ejected rank is sent a 1-token completion this often; answered 200
    # within probe_timeout_s, it is back in rotation.
    probe_interval_s: float = Field(5.0, gt=0)
    probe_timeout_s: float = Field(10.0, gt=0)


class Limits(BaseModel):
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # A rank's answer read whole (non-streamed, an error's body): larger is
    # 502, never kept. Token ids and logprobs of a long answer fit well below.
    max_upstream_body_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # What the proxy reads whole from a rank for itself (proxy.upstream.bounded): a
    # status poll's answer (/fault_tolerance/status, /health) and recovery's
    # apply answer, and a model list. Larger fails that poll or call (the rank
    # is unreachable until its next good poll); vLLM's are a few hundred bytes.
    max_status_bytes: int = Field(1024 * 1024, gt=0)
    max_model_list_bytes: int = Field(4 * 1024 * 1024, gt=0)
    # A connection's request headers must be in within this (from connect or
    # from its previous answer), its body within body_timeout_s: else 408.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    # A client that takes no byte of its answer for this long is cut (nginx's
    # send_timeout): else one that stops reading holds its rank's connection,
    # its place in max_requests and the unsent answer (proxy.ingress.sendwatch).
    send_timeout_s: float = Field(300.0, gt=0)
    keepalive_timeout_s: float = Field(75.0, gt=0)  # idle client connection
    # Beyond these: 503 with Retry-After. A held stream is a connection and a
    # request; each holds two descriptors (client and upstream).
    max_connections: int = Field(10_000, gt=0)
    max_requests: int = Field(10_000, gt=0)
    # Requests waiting for a healthy rank (timeouts.queue_s) at once.
    max_queued: int = Field(1_000, ge=0)
    # Streams held through a fault at once; one more that needs a continuation
    # ends with an error event (code hold_capacity).
    max_held_streams: int = Field(10_000, ge=0)
    # Extra ranks tried when a rank fails before the first byte is sent.
    upstream_retries: int = Field(2, ge=0)
    # Open connections to one rank (held streams each keep one); beyond it a
    # request waits for a free one.
    upstream_connections_per_rank: int = Field(8192, ge=1)


class CacheAware(BaseModel):
    """The cache-aware routing policy (proxy.control.prefix)."""

    # A typo here would silently leave a default in force.
    model_config = ConfigDict(extra="forbid")

    # Tokens per block, as the engines' --block-size (vLLM's default 16): only
    # whole blocks are cached, so only whole blocks are matched.
    block_size: int = Field(16, ge=1, le=4096)
    # Blocks remembered per rank (least recently used go first): with the
    # default, ~1.6M tokens of prefixes a rank, ~14 MB of memory each when full.
    max_blocks_per_rank: int = Field(100_000, ge=1)
    # A rank whose load (in flight plus its picks among the last
    # recent_window) is over its weighted share by more than this fraction
    # and by more than balance_abs requests is skipped (SGLang's
    # balance_rel_threshold and balance_abs_threshold).
    balance_margin: float = Field(0.5, ge=0)
    balance_abs: int = Field(4, ge=0)
    recent_window: int = Field(64, ge=1)
    # Stick a conversation to its rank while routable: "user" (the body's
    # field) or "header:<name>"; None: prefixes alone decide.
    session_key: str | None = None

    @field_validator("session_key")
    @classmethod
    def _session_source(cls, v: str | None) -> str | None:
        if v is None or v == "user":
            return v
        name = v.removeprefix("header:")
        if name == v or not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError('must be "user" or "header:<header name>", e.g. "header:X-Session-Id"')
        return v


class Routing(BaseModel):
    """Which rank endpoints clients may call through the proxy (see proxy.core.target),
    and how a rank is picked for a request."""

    # "METHOD /path"; anything else is 404. Rank control, health and metrics
    # paths are refused here, whatever the config says.
    forward: list[str] = Field(default_factory=lambda: list(DEFAULT_FORWARD))
    # weighted: smooth weighted round-robin (proxy.control.balancer); cache_aware:
    # completions and chat go where their prompt's prefix is cached (proxy.control.prefix).
    policy: Literal["weighted", "cache_aware"] = "weighted"
    cache_aware: CacheAware = CacheAware()

    @field_validator("forward")
    @classmethod
    def _safe(cls, v: list[str]) -> list[str]:
        entries = [" ".join(parse_forward(e)) for e in v]
        if len(set(entries)) != len(entries):
            raise ValueError("repeated entry")
        return entries


class Logging(BaseModel):
    # One line per client request, written when it ends (see proxy.telemetry.accesslog).
    access_log: bool = True
    # text: readable lines; json: one object per line with stable keys.
    format: Literal["text", "json"] = "text"


class Shutdown(BaseModel):
    """Graceful drain on SIGTERM (see proxy.ingress.drain)."""

    # /ready answers 503 this long, everything else served as before, so load
    # balancers (Kubernetes endpoints) stop sending new connections first.
    ready_delay_s: float = Field(5.0, ge=0)
    # Then the listener closes and what is in flight gets this long to finish;
    # what is left ends with a proxy_shutdown error event.
    grace_s: float = Field(30.0, ge=0)


class EtcdConfig(BaseModel):
    """etcd v3 (its JSON gateway, over the HTTP client the proxy already has)."""

    endpoints: list[str] = Field(min_length=1)  # e.g. ["http://etcd-0:2379"]; tried in turn
    prefix: str = Field("/ftproxy", min_length=1)  # every key lives under it
    # A leader that stops renewing loses leadership (and a round it runs is
    # taken over) after this long.
    lease_ttl_s: int = Field(5, ge=2, le=300)
    # Each call's bound, and for the watch stream its head's and then each
    # message's from its first byte.
    timeout_s: float = Field(2.0, gt=0)
    # Each answer and each watch message: larger fails that call (the watch
    # is opened again); the proxy's own keys take a few KiB a group.
    max_answer_bytes: int = Field(4 * 1024 * 1024, gt=0)
    ca_file: Path | None = None  # TLS: verify etcd with this CA
    cert_file: Path | None = None  # TLS client certificate (mutual TLS) ...
    key_file: Path | None = None  # ... and its key
    username: str | None = None  # etcd auth (user + password -> token)
    password: SecretStr | None = None

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must start with http:// or https://")
        return [u.rstrip("/") for u in v]


class CoordinationConfig(BaseModel):
    # None: one process coordinates in memory; --workers N on one host uses
    # a flock. etcd: any number of replicas and workers (proxy.control.coordination).
    etcd: EtcdConfig | None = None


class TracingConfig(BaseModel):
    """OpenTelemetry traces (proxy.telemetry.tracing); needs the ``otel`` extra."""

    enabled: bool = False
    # otlp: OTLP over HTTP to otlp_endpoint; console: stdout; none: spans are
    # made and traceparent sent to ranks, but exported nowhere.
    exporter: Literal["otlp", "console", "none"] = "otlp"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "ft-proxy"
    sample_ratio: float = Field(1.0, ge=0, le=1)  # of traces started here

    @model_validator(mode="after")
    def _installed(self) -> TracingConfig:
        if self.enabled and importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError(
                "tracing is enabled but the OpenTelemetry SDK is not installed: "
                "pip install 'ft-proxy[otel]'"
            )
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FTPROXY_", env_nested_delimiter="__", extra="forbid"
    )

    listen: Listen = Listen()
    groups: list[GroupConfig] = Field(min_length=1)
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    hold: Hold = Hold()
    liveness: Liveness = Liveness()
    admin: Admin = Admin()
    # How https:// rank URLs are verified, and a client certificate for them.
    upstream_tls: UpstreamTLS = UpstreamTLS()
    routing: Routing = Routing()
    shutdown: Shutdown = Shutdown()
    # Worker processes sharing the listener (proxy.supervisor); 1: no supervisor.
    workers: int = Field(1, ge=1, le=64)
    coordination: CoordinationConfig = CoordinationConfig()
    # Optional data-plane API keys (Authorization: Bearer <key>).
    api_keys: list[SecretStr] = []
    # The ranks' own key (vLLM's --api-key guards every /v1 path, the newer
    # FT routes included): sent to them on every request, the client's never.
    upstream_api_key: SecretStr | None = None
    log_level: str = "INFO"
    logging: Logging = Logging()
    tracing: TracingConfig = TracingConfig()

    @field_validator("upstream_api_key")
    @classmethod
    def _usable_rank_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().isascii():
            # Sent as UTF-8, read by the rank's server as latin-1: never its key.
            raise ValueError("must be ASCII")
        return _usable_secret(v)

    @field_validator("api_keys")
    @classmethod
    def _usable_keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        for key in v:
            _usable_secret(key)
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        names = [r.name for g in self.groups for r in g.ranks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rank names must be unique, repeated: {', '.join(dupes)}")
        groups = [g.name for g in self.groups]
        if len(set(groups)) != len(groups):
            raise ValueError("group names must be unique")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (which arrives as init kwargs).
        return env_settings, init_settings


def load_settings(path: Path | str) -> Settings:
    """Read and validate the YAML file; raise ConfigError with a clear message."""
    path = Path(path)
    try:
        data: Any = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text: {e.reason} at byte {e.start}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    if odd := [k for k in data if not isinstance(k, str)]:  # `1: 2` would be a keyword
        raise ConfigError(f"{path}: top-level keys must be names, not {odd[0]!r}")
    try:
        return Settings(**data)
    except ValidationError as e:
        raise ConfigError(f"{path}: {_describe(e)}") from None


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"field '{where}': {item['msg']}")
    return "; ".join(lines)
