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

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from teamdesk import tracing

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
    tracing.switch_on()
    return True


FLUSH_TIMEOUT_MS = 2_000  # a process exiting waits at most this for its last spans


def flush() -> None:
    """Export the spans still queued (a pool child about to exit: billiard ends it with
    ``os._exit``, which runs no ``atexit``, so the SDK's own flush would never come)."""
    provider = trace.get_tracer_provider()
    if tracing.enabled() and isinstance(provider, TracerProvider):
        provider.force_flush(FLUSH_TIMEOUT_MS)
