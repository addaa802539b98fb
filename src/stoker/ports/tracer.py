"""The Tracer port: spans around the steps of a claim, and their context for a worker.

A claim opens one span (`stoker.claim`) whose children are the steps it took: reserving a
worker (`stoker.reserve`), activating it (`stoker.activate`) and binding the claim
(`stoker.bind`). The activation's request carries the W3C trace context
(`traceparent`) of its span, so a worker that traces joins the claim's trace.

`NO_TRACER` does nothing and costs next to nothing: it is every replica's tracer unless
the config turns tracing on (`tracing:`), which needs the `tracing` extra (OpenTelemetry;
`stoker.adapters.tracing_otel`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

#: What a span's attribute may hold.
AttributeValue = str | int | float | bool


class Span(Protocol):
    """An open span: what a step learnt on its way is set on it."""

    def set(self, key: str, value: AttributeValue) -> None:
        """Set attribute `key` (e.g. the claim's id once it is bound)."""
        ...


class Tracer(Protocol):
    """Opens spans, and hands the current one's context to outgoing requests."""

    def span(self, name: str, **attributes: AttributeValue) -> AbstractContextManager[Span]:
        """A span named `name`, current while the block runs (a child of the span current
        where it opens); an exception leaving the block marks it failed."""
        ...

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Add the current span's context to `headers` (`traceparent`, `tracestate`)."""
        ...

    def continued(self, headers: Mapping[str, str]) -> AbstractContextManager[None]:
        """Make the trace context that `headers` carry (an incoming `traceparent`) the
        parent of the spans opened in the block."""
        ...

    def close(self) -> None:
        """Send what is still buffered, and stop."""
        ...


class _NoSpan:
    def set(self, key: str, value: AttributeValue) -> None:
        """Nothing to set."""


class NoTracer:
    """No spans: every method returns at once."""

    _span: AbstractContextManager[Span] = nullcontext(_NoSpan())
    _none: AbstractContextManager[None] = nullcontext()

    def span(self, name: str, **attributes: AttributeValue) -> AbstractContextManager[Span]:
        """A block that records nothing."""
        return self._span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Adds nothing."""

    def continued(self, headers: Mapping[str, str]) -> AbstractContextManager[None]:
        """A block that changes nothing."""
        return self._none

    def close(self) -> None:
        """Nothing to send."""


#: The tracer of a replica that does not trace.
NO_TRACER: Tracer = NoTracer()
