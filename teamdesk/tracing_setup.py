"""The OpenTelemetry SDK in a process that wants traces (teamdesk/tracing.py says when).

:func:`configure` installs the SDK's tracer provider once per process (the API, beat, a
worker's main process before it forks its pool: the batch processor restarts its thread
in each child) and exports spans over OTLP/HTTP in batches; the sampler is
``OTEL_TRACES_SAMPLER``'s (default: parent-based, always on), ``service.name`` is
``OTEL_SERVICE_NAME`` or ``teamdesk-<process>``. Every other ``OTEL_*`` variable of the
SDK and the exporter applies as documented there. Only the processes' entry modules
import this one: the SDK, the exporter, protobuf and requests load there, never in the
command line or a library user.
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
    # A context comes from the ledger row or our own message header only (teamdesk/
    # tracing.py), never from a client's headers: an internet-facing API must not let a
    # caller choose the trace id or switch sampling off (or on) for the work it queues.
    propagate.set_global_textmap(NoIncomingContext())
    tracing.switch_on()
    return True


FLUSH_TIMEOUT_S = 2.0  # a process exiting waits at most this for its last spans


def flush() -> None:
    """Export the spans still queued (a pool child about to exit: billiard ends it with
    ``os._exit``, which runs no ``atexit``, so the SDK's own flush would never come), for
    at most :data:`FLUSH_TIMEOUT_S`. The SDK's ``force_flush`` ignores its own timeout
    (1.45) and waits out the exporter's retries against a collector that is down or
    silent (15-20 s a child, measured), so it runs on a daemon thread joined with the
    bound: whatever is not out by then is dropped, the exit is not held."""
    provider = trace.get_tracer_provider()
    if not (tracing.enabled() and isinstance(provider, TracerProvider)):
        return
    sender = threading.Thread(target=provider.force_flush, name="trace-flush", daemon=True)
    sender.start()
    sender.join(FLUSH_TIMEOUT_S)
