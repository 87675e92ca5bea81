"""The API's request metrics, from one ASGI middleware (docs/design.md, "Observe").

The route label is the matched template, never the path, so ids never become labels.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from teamdesk import metrics

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

REQUESTS = Counter(
    "teamdesk_api_requests",
    "HTTP requests by route template, method and status.",
    ["route", "method", "status"],
    registry=metrics.REGISTRY,
)
LATENCY = Histogram(
    "teamdesk_api_request_duration_seconds",
    "HTTP request latency by route template and method, until the answer's last byte.",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
    registry=metrics.REGISTRY,
)


class RequestMetrics:
    """Sees every answer, the other middlewares' own 413s and 500s too (api/app.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless an answer starts

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"] if scope["method"] in METHODS else "other"
            REQUESTS.labels(route, method, str(status)).inc()
            LATENCY.labels(route, method).observe(time.perf_counter() - started)
