"""The OpenTelemetry SDK in a process that wants traces (docs/design.md, "Tracing").

Only the processes' entry modules import this: the SDK, exporter, protobuf and requests
never load in the command line or a library user.
"""

from __future__ import annotations

import os
import threading

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from teamdesk import tracing


class NoIncomingContext(TextMapPropagator):
    """The process-wide propagator: takes no context from a carrier (a request's headers
    start a new trace) and writes none into one."""

    def extract(
        self,
        carrier: CarrierT,
        context: Context | None = None,
        getter: Getter[CarrierT] = default_getter,
    ) -> Context:
        return context if context is not None else Context()

    def inject(
        self,
        carrier: CarrierT,
        context: Context | None = None,
        setter: Setter[CarrierT] = default_setter,
    ) -> None:
        return None

    @property
    def fields(self) -> set[str]:
        return set()


_configured: list[bool] = []  # once per process (a forked child keeps its parent's)


def configure(process: str) -> bool:
    """Install the tracer provider in this process if the environment asks
    (:func:`teamdesk.tracing.wanted`); whether tracing is on."""
    if _configured:
        return tracing.enabled()
    _configured.append(True)
    if not tracing.wanted():
        return False
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip() or f"teamdesk-{process}"
    resource = Resource.create({SERVICE_NAME: name, tracing.PREFIX + "process": process})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    # Never a client's headers: a caller must not choose the trace id or the sampling.
    propagate.set_global_textmap(NoIncomingContext())
    tracing.switch_on()
    return True


FLUSH_TIMEOUT_S = 2.0  # a process exiting waits at most this for its last spans


def flush() -> None:
    """Export the spans still queued (a pool child about to ``os._exit``), for at most
    :data:`FLUSH_TIMEOUT_S`: the SDK's ``force_flush`` ignores its own timeout (1.45), so
    it runs on a daemon thread joined with the bound, and what is not out is dropped."""
    provider = trace.get_tracer_provider()
    if not (tracing.enabled() and isinstance(provider, TracerProvider)):
        return
    sender = threading.Thread(target=provider.force_flush, name="trace-flush", daemon=True)
    sender.start()
    sender.join(FLUSH_TIMEOUT_S)
