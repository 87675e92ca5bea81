"""OpenTelemetry traces, off unless the standard variables ask (docs/design.md, "Tracing").

Only OpenTelemetry's API: what imports this (every log line's formatter) never loads the
SDK, which teamdesk/tracing_setup.py installs. Off, everything here is a flag test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "teamdesk"
HEADER = "traceparent"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
PREFIX = "teamdesk."  # span attributes: teamdesk.task_id, teamdesk.run, ...

_PROPAGATOR = TraceContextTextMapPropagator()
_state = {"on": False}
_tracers: list[trace.Tracer] = []  # the process's tracer, once tracing is on


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (docs/design.md, "Tracing")."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() not in ("otlp", ""):
        return False  # "none", or an exporter this project does not ship ("console"...)
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


def switch_on() -> None:
    """Spans from now on (teamdesk/tracing_setup.py installed the SDK's provider)."""
    _tracers.append(trace.get_tracer(TRACER_NAME))  # once: the SDK builds one per call
    _state["on"] = True


def enabled() -> bool:
    return bool(_state["on"])


def tracer() -> trace.Tracer:
    return _tracers[-1] if _tracers else trace.get_tracer(TRACER_NAME)


def current_parent() -> str | None:
    """The current span's context as a ``traceparent`` (for the ledger row), None when
    tracing is off or no span is active."""
    if not _state["on"]:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(HEADER)


def context_of(parent: str | None) -> otel_context.Context | None:
    """The context a stored or received ``traceparent`` names (None: none, or invalid:
    a message header may hold anything, even another type, and must never fail a run)."""
    if not parent or not isinstance(parent, str):
        return None
    extracted = _PROPAGATOR.extract({HEADER: parent})
    if not trace.get_current_span(extracted).get_span_context().is_valid:
        return None
    return extracted


def links_to(parent: str | None) -> list[Link]:
    """A link to the span a ``traceparent`` names (none when it names none)."""
    found = context_of(parent)
    if found is None:
        return []
    return [Link(trace.get_current_span(found).get_span_context())]


def attributes(**values: Any) -> dict[str, Any]:
    """Span attributes under ``teamdesk.``; None values left out, ids as text."""
    return {
        PREFIX + key: value if isinstance(value, bool | int | float) else str(value)
        for key, value in values.items()
        if value is not None
    }


@contextmanager
def span(
    name: str,
    *,
    parent: str | None = None,
    root: bool = False,
    link: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    errors: bool = True,
    **values: Any,
) -> Iterator[Span | None]:
    """A span while tracing is on (else None): the child of ``parent`` (a ``traceparent``),
    else a new trace's first with ``root``, else the current span's child; linked to
    ``link``. Without ``errors`` an exception does not mark it failed (Celery ends a retry
    or a revoke by raising)."""
    if not _state["on"]:
        yield None
        return
    if parent is not None:
        parent_context = context_of(parent)
    else:
        parent_context = otel_context.Context() if root else None
    with tracer().start_as_current_span(
        name,
        context=parent_context,
        kind=kind,
        links=links_to(link),
        attributes=attributes(**values),
        record_exception=errors,
        set_status_on_exception=errors,
    ) as current:
        yield current


def add_link(current: Span | None, parent: str | None) -> None:
    """Link ``current`` (a span of :func:`span`, or None) to the span ``parent`` names."""
    if current is not None:
        for found in links_to(parent):
            current.add_link(found.context)


def event(name: str, **values: Any) -> None:
    """An event on the active span: a step, at this instant."""
    if _state["on"]:
        trace.get_current_span().add_event(name, attributes(**values))


def annotate_current(**values: Any) -> None:
    """:func:`annotate` the active span (nothing, not even its lookup, when off)."""
    if _state["on"]:
        annotate(trace.get_current_span(), **values)


def failed(current: Span | None, exc: BaseException) -> None:
    """Mark ``current`` failed by ``exc`` (its class only: messages may hold data)."""
    if current is not None:
        current.set_status(Status(StatusCode.ERROR, type(exc).__name__))


def annotate(current: Span | None, **values: Any) -> None:
    """Set ``teamdesk.*`` attributes on ``current`` (a span of :func:`span`, or None)."""
    if current is not None and _state["on"]:
        current.set_attributes(attributes(**values))


def log_fields() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the active span, for a log record (none when off)."""
    if not _state["on"]:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
