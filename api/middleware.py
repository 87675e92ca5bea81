"""Three small ASGI middlewares: security headers, a request-size limit and a last-resort
error answer.

:class:`SecurityHeaders` adds ``X-Content-Type-Options: nosniff``, ``X-Frame-Options:
DENY`` and a ``Content-Security-Policy`` to every answer (``default-src 'none'`` for data,
a policy that lets the documentation pages load only from this server: ``DOCS_CSP``), and
``Cache-Control: no-store`` to every ``/api/`` answer that does not set its own (task
views carry the team's data: no proxy or browser cache may keep them).

:class:`BodyLimit` answers 413 to a body over :data:`MAX_BODY_BYTES` (by its
``Content-Length``, or by counting a chunked body while buffering it) before any route
runs. :class:`LastResort` turns an unexpected exception into ``500 {"detail": "internal
error"}`` and logs only its class and where it was raised: Starlette's own handler would
log the exception's text, and a database error's text holds SQL parameters, which hold
request bodies.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 64 * 1024
MSG_TOO_LARGE = f"the request body must be at most {MAX_BODY_BYTES // 1024} KiB"
MSG_INTERNAL = "internal error"

logger = logging.getLogger(__name__)


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_bytes:
            await send_json(send, 413, {"detail": MSG_TOO_LARGE})
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await send_json(send, 413, {"detail": MSG_TOO_LARGE})
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


NOSNIFF = (b"x-content-type-options", b"nosniff")
NO_STORE = (b"cache-control", b"no-store")
NO_FRAMES = (b"x-frame-options", b"DENY")
# Everything but the documentation pages is data: it may load nothing and be framed by
# nothing.
API_CSP = (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'")
# /docs (Swagger UI) and /redoc: their scripts, styles and fonts come from this server
# (FastAPIOffline), they fetch /openapi.json, Redoc runs a web worker from a blob: URL and
# both set inline styles; Swagger UI starts from an inline script. The pages show the
# OpenAPI description only (no user data, no token), and nothing may frame them, load
# from or connect to another origin, embed plugins or rebase their links.
DOCS_CSP = (
    b"content-security-policy",
    b"default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    b"img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
    b"worker-src 'self' blob:; object-src 'none'; base-uri 'none'; form-action 'none'; "
    b"frame-ancestors 'none'",
)
DOCS_PATHS = frozenset({"/docs", "/redoc", "/docs/oauth2-redirect"})


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        private = path.startswith("/api/")
        csp = DOCS_CSP if path in DOCS_PATHS else API_CSP

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers += [NOSNIFF, NO_FRAMES, csp]
                if private and b"cache-control" not in names:
                    headers.append(NO_STORE)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class LastResort:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error(
                "unexpected error", extra={"error": type(exc).__name__, "where": _our_frame(exc)}
            )
            if started:
                raise RuntimeError("response already started") from None
            await send_json(send, 500, {"detail": MSG_INTERNAL})


def _our_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame in this project's code (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "site-packages" not in f.filename] or frames
    if not ours:
        return "unknown"
    return f"{ours[-1].filename}:{ours[-1].lineno}"
