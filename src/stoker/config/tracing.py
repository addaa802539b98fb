"""The `tracing:` section: OpenTelemetry spans of each claim (the `tracing` extra).

    tracing:
      enabled: true
      endpoint: http://otel-collector:4318    # OTLP over HTTP; /v1/traces is added
      service_name: stoker
      sample_ratio: 0.1                       # of the traces this server starts

Unset, each field falls back to the standard OpenTelemetry variables, read by the SDK:
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`. With `enabled` unset, tracing is on when
one of the endpoint variables is set (and `OTEL_SDK_DISABLED` is not `true`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from stoker.config.schema import Section

#: The variables whose presence turns tracing on when `enabled` is unset.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

#: How tracing was asked for: not at all, by the config, or by the environment alone.
TracingMode = Literal["off", "on", "implied"]


def _collector_url(value: str) -> str:
    """`value` if it is an http(s) URL naming a host (the exporter would fail to start on
    `http://[::1`, or send nowhere with `http://`)."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (read for its ValueError on a port that is no number)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a URL: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{value!r} names no host")
    return value


#: An OTLP/HTTP collector's URL.
CollectorUrl = Annotated[
    str, Field(min_length=1, pattern=r"^https?://"), AfterValidator(_collector_url)
]


class TracingConfig(Section):
    """OpenTelemetry tracing of claims; see the module's doc for the OTEL_* fallbacks."""

    #: True or false; null: on when an OTLP endpoint variable is set.
    enabled: bool | None = None
    #: The OTLP/HTTP collector, e.g. `http://otel-collector:4318` (`/v1/traces` is
    #: added unless the URL has a path); null: the OTEL_* variables, else localhost:4318.
    endpoint: CollectorUrl | None = None
    #: The `service.name` of the spans; null: `OTEL_SERVICE_NAME`, else "stoker".
    service_name: str | None = Field(None, min_length=1, max_length=256)
    #: The share of the traces this server starts that are recorded (a trace an incoming
    #: `traceparent` continues follows its parent's decision); null: `OTEL_TRACES_SAMPLER*`,
    #: else all of them.
    sample_ratio: float | None = Field(None, ge=0, le=1)

    def mode(self, environ: Mapping[str, str]) -> TracingMode:
        """Whether to trace: `on` (the config says so), `implied` (only the environment
        names an endpoint) or `off`."""
        if self.enabled is not None:
            return "on" if self.enabled else "off"
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return "off"
        return "implied" if any(environ.get(v) for v in ENDPOINT_VARIABLES) else "off"
