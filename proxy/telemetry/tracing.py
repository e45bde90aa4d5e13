"""Optional OpenTelemetry traces (``tracing.enabled``; the ``otel`` extra).

Off by default, and then nothing here is imported by a request. When on,
each client request gets a span with children::

    POST /v1/completions            server span, one per client request
    ├── upstream r0                 client span per upstream attempt
    ├── hold                        a stream on hold (reason, how it resumed)
    └── continuation                finding a rank to continue on
        └── upstream r1

Every upstream attempt carries a W3C ``traceparent`` naming its span, so a
rank that exports its own spans (vLLM ``--otlp-traces-endpoint``) joins the
trace. A ``traceparent`` the client sent becomes the request span's parent.
The provider is the app's own (no process-global state), shut down with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from proxy.core.settings import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span, Status


Attrs = Mapping[str, str | int | float | bool]


class Tracing:
    def __init__(self, cfg: TracingConfig) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        exporter = _exporter(cfg)
        if exporter is not None:
            self.provider.add_span_processor(exporter)
        self.tracer = self.provider.get_tracer("ftproxy")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is still batched

    def request(
        self, name: str, headers: Mapping[str, str], attrs: Attrs
    ) -> AbstractContextManager[Span]:
        """The client request's span, current while it is served."""
        from opentelemetry.trace import SpanKind

        return self.tracer.start_as_current_span(
            name,
            context=self.propagator.extract(headers),
            kind=SpanKind.SERVER,
            attributes=attrs,
            record_exception=False,
            set_status_on_exception=False,
        )

    @contextmanager
    def attempt(self, name: str, headers: MutableMapping[str, str], attrs: Attrs) -> Iterator[Span]:
        """An upstream attempt's span; ``headers`` get its ``traceparent``."""
        from opentelemetry.trace import SpanKind

        with self.tracer.start_as_current_span(
            name, kind=SpanKind.CLIENT, attributes=attrs, record_exception=False
        ) as span:
            headers.pop("traceparent", None)
            headers.pop("tracestate", None)
            self.propagator.inject(headers)
            yield span

    def span(self, name: str, attrs: Attrs) -> AbstractContextManager[Span]:
        """A child of the current span, current while the block runs."""
        return self.tracer.start_as_current_span(name, attributes=attrs)

    def start(self, name: str, attrs: Attrs) -> Span:
        """A child of the current span that the caller ends (a hold)."""
        return self.tracer.start_span(name, attributes=attrs)


def _exporter(cfg: TracingConfig) -> SpanProcessor | None:
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    if cfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint))
    if cfg.exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    return None


def error_status() -> Status:
    """The status of a span whose request failed."""
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR)
