"""The ASGI application, ``uvicorn api.app:app`` (docs/design.md, "HTTP API").

Routes and their answers: docs/api.md, "Routes". Error bodies are ``{"detail": "<fixed message>"}``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from api import errors, health, tasks
from api.metrics import RequestMetrics
from api.middleware import BodyLimit, ForwardedClient, LastResort, SecurityHeaders
from api.resources import Resources
from teamdesk import metrics, tracing_setup
from teamdesk.config import ProxyNetwork, Settings, trusted_proxies
from teamdesk.logs import setup_logging
from teamdesk.version import version

SERVICE = "api"
TRACE_EXCLUDED_URLS = "api/health$,api/workers/health$"  # probes: no span
# uvicorn's own loggers: routed to the root logger so their lines are JSON too.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def _json_logs(level: str) -> None:
    setup_logging(SERVICE, level)
    for name in UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True  # uvicorn's color_message: dropped by teamdesk.logs


def _metrics_endpoint(settings: Settings) -> Any:
    """``/metrics`` on METRICS_HOST:METRICS_PORT, a port apart from the API's (off: 0)."""
    if not settings.metrics_port:
        return None
    return metrics.serve(settings.metrics_port, settings.metrics_host)


Handler = Callable[[Request, Exception], Awaitable[Response]]


def _answering_refusals(handler: Handler) -> Handler:
    """``handler``, with the HTTP error it raises itself as the answer: while answering an
    invalid request (422, or 404 for a malformed id) it takes from the live token's budget
    (api/deps.py, ``token_is_valid``), which answers 429 once that budget is spent."""

    async def answer(request: Request, exc: Exception) -> Response:
        try:
            return await handler(request, exc)
        except StarletteHTTPException as refused:
            return await http_exception_handler(request, refused)

    return answer


def _install_errors(app: FastAPI) -> None:
    errors.install(app)
    # The two handlers that answer invalid requests (api/errors.py), in its place.
    app.add_exception_handler(RequestValidationError, _answering_refusals(errors.invalid_request))
    app.add_exception_handler(StarletteHTTPException, _answering_refusals(errors.http_error))


def _proxies(given: Sequence[ProxyNetwork] | None) -> Callable[[], Sequence[ProxyNetwork]]:
    """The trusted proxies: ``given``, or FORWARDED_ALLOW_IPS read once, on first use."""
    if given is not None:
        fixed = tuple(given)
        return lambda: fixed
    return functools.cache(trusted_proxies)


def create_api(
    settings: Settings | None = None,
    *,
    configure_logging: bool = True,
    proxies: Sequence[ProxyNetwork] | None = None,
) -> FastAPI:
    """Build the app; ``settings=None`` reads the environment on first use, not at import.

    ``configure_logging=False`` keeps pytest's capture; ``proxies=None`` reads
    FORWARDED_ALLOW_IPS.
    """
    res = Resources(settings)
    trusted = _proxies(proxies)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        trusted()  # a bad FORWARDED_ALLOW_IPS stops the start, not each request
        if configure_logging:
            _json_logs(res.settings.log_level)
        endpoint = _metrics_endpoint(res.settings)
        try:
            yield
        finally:
            if endpoint is not None:
                endpoint.shutdown()
                endpoint.server_close()
            res.close()

    # FastAPIOffline: /docs and /redoc load their scripts from this server, not a CDN.
    app = FastAPIOffline(
        title="TeamDesk tasks API",
        version=version(),
        description="Health probes and background tasks (exports, reminders) of TeamDesk. "
        "Task routes need `Authorization: Bearer <token>`.",
        lifespan=lifespan,
    )
    app.state.resources = res
    app.include_router(health.router)
    app.include_router(tasks.router)
    _install_errors(app)
    app.add_middleware(LastResort)
    app.add_middleware(BodyLimit)
    app.add_middleware(SecurityHeaders)  # 413 and 500 answers get them too
    app.add_middleware(RequestMetrics)  # counts every answer
    app.add_middleware(ForwardedClient, trusted=trusted)  # outermost: all see the client
    if tracing_setup.configure("api"):  # docs/design.md, "Tracing"
        FastAPIInstrumentor.instrument_app(
            app, excluded_urls=TRACE_EXCLUDED_URLS, exclude_spans=["receive", "send"]
        )
    return app


app = create_api()
