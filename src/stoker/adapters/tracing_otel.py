"""The Tracer port on OpenTelemetry (the `tracing` extra): claim spans exported over OTLP.

Imported only when the config turns tracing on (`stoker.bootstrap.build_tracer`), so a
server without the extra never loads it. Spans go through the SDK's batch processor to an
OTLP/HTTP exporter; the trace context travels in W3C `traceparent`/`tracestate` headers.
The provider is the tracer's own, not the process-wide one: an application or test that
sets a global provider is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span as OtelSpan
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stoker._version import __version__
from stoker.ports.tracer import AttributeValue, Span

#: The service name when neither the config nor `OTEL_SERVICE_NAME` gives one.
DEFAULT_SERVICE_NAME = "stoker"
#: Where OTLP/HTTP takes spans, below a collector's base URL.
TRACES_PATH = "/v1/traces"


class _Span:
    """`Span` over an OpenTelemetry span."""

    __slots__ = ("_span",)

    def __init__(self, span: OtelSpan) -> None:
        self._span = span

    def set(self, key: str, value: AttributeValue) -> None:
        """Set one attribute."""
        self._span.set_attribute(key, value)


class OtelTracer:
    """Implements the `Tracer` port on an OpenTelemetry SDK `TracerProvider`."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("stoker", __version__)
        self._propagator = TraceContextTextMapPropagator()

    @contextmanager
    def span(self, name: str, **attributes: AttributeValue) -> Iterator[Span]:
        """A span current for the block; an exception leaving it is recorded on it."""
        with self._tracer.start_as_current_span(name, attributes=attributes or None) as span:
            yield _Span(span)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add `traceparent` (and `tracestate`) of the current span to `headers`."""
        self._propagator.inject(headers)

    @contextmanager
    def continued(self, headers: Mapping[str, str]) -> Iterator[None]:
        """Spans opened in the block continue the trace `headers` carry, if any."""
        if "traceparent" not in headers:
            yield
            return
        token = otel_context.attach(self._propagator.extract(headers))
        try:
            yield
        finally:
            otel_context.detach(token)

    def close(self) -> None:
        """Export the spans still buffered, then stop."""
        self.provider.shutdown()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: `/v1/traces` added to a bare base URL."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def otlp_tracer(
    *,
    endpoint: str | None = None,
    service_name: str | None = None,
    sample_ratio: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> OtelTracer:
    """A tracer exporting over OTLP/HTTP; what is None falls back to the OTEL_* variables
    (read by the SDK), then to OpenTelemetry's defaults."""
    attributes: dict[str, Any] = {}
    if service_name is not None:
        attributes[SERVICE_NAME] = service_name
    elif not (environ or {}).get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    sampler = None if sample_ratio is None else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return OtelTracer(provider)
