"""An OTLP/HTTP trace receiver for tests: what real exporters send, decoded and kept.

It answers ``POST /v1/traces`` (protobuf, gzip or not) as a collector does and keeps
every span with its service name, so a test can read the traces processes exported.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's first span
    kind: int
    attributes: dict[str, Any]
    links: tuple[str, ...]  # the trace ids it links to
    status_code: int
    events: tuple[tuple[str, dict[str, Any]], ...]  # name and attributes, in time order


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    return None if which is None else getattr(any_value, which)


@dataclass
class OtlpReceiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def keep(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=int(span.kind),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=tuple(link.trace_id.hex() for link in span.links),
                            status_code=int(span.status.code),
                            events=tuple(
                                (e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in sorted(span.events, key=lambda e: e.time_unix_nano)
                            ),
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_receiver() -> OtlpReceiver:
    """A receiver on a free port of 127.0.0.1, serving on its own thread."""
    holder: list[OtlpReceiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != TRACES_PATH:
                self.send_error(404)
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            holder[0].keep(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = OtlpReceiver(server)
    holder.append(receiver)
    threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True).start()
    return receiver
