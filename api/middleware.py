"""ASGI middlewares: security headers, a request-size limit, a last-resort 500 and the
client's address behind trusted proxies (docs/design.md, "HTTP API"; docs/api.md,
"Serving it" and "Behind a reverse proxy").

:class:`LastResort` logs only the error's class and frame: Starlette's handler would log
its text, and a database error's text holds SQL parameters, which hold request bodies.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from teamdesk.config import ProxyNetwork

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
API_CSP = (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'")
# /docs and /redoc load only from this server; Redoc runs a worker from a blob: URL, both
# set inline styles. Their two inline scripts (Swagger UI's start, the OAuth2 redirect
# page's) are allowed by SHA-256, never by 'unsafe-inline'.
DOCS_POLICY = (
    "default-src 'self'; script-src 'self' {scripts}; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
    "worker-src 'self' blob:; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
DOCS_PATHS = frozenset({"/docs", "/redoc", "/docs/oauth2-redirect"})
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def script_sources(html: str) -> list[str]:
    """A CSP source (``'sha256-<base64>'``) for each inline script of ``html``."""
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in INLINE_SCRIPT.findall(html)
    ]


def docs_policy(app: Any, root_path: str) -> bytes:
    """The documentation pages' policy for ``app`` (a FastAPI app) under ``root_path``.
    Swagger UI's start script depends only on the OpenAPI URL, the redirect page's URL and
    the Swagger parameters (not the title or asset URLs), so it is rendered from those here
    and hashed (tests/unit/test_api_docs_policy.py checks the served pages)."""
    swagger = get_swagger_ui_html(
        openapi_url=f"{root_path}{app.openapi_url}",
        title="",
        oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url,
        swagger_js_url="",
        swagger_css_url="",
        swagger_ui_parameters=app.swagger_ui_parameters,
    )
    redirect = get_swagger_ui_oauth2_redirect_html()
    pages = (bytes(swagger.body).decode(), bytes(redirect.body).decode())
    scripts = [source for page in pages for source in script_sources(page)]
    return DOCS_POLICY.format(scripts=" ".join(scripts)).encode()


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._docs_policies: dict[str, tuple[bytes, bytes]] = {}  # by root path

    def _docs_csp(self, scope: Scope) -> tuple[bytes, bytes]:
        """The docs' policy header for the app being served (Starlette's ``scope["app"]``)."""
        root_path = str(scope.get("root_path", ""))
        if root_path not in self._docs_policies:
            policy = docs_policy(scope["app"], root_path)
            self._docs_policies[root_path] = (b"content-security-policy", policy)
        return self._docs_policies[root_path]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        private = path.startswith("/api/")
        csp = self._docs_csp(scope) if path in DOCS_PATHS else API_CSP

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


Address = ipaddress.IPv4Address | ipaddress.IPv6Address
FORWARDED_PROTOS = frozenset({"http", "https", "ws", "wss"})


def parse_address(text: str | None) -> Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 address as its IPv4 address; a
    ``[v6]:port`` or ``v4:port`` hop without its port), or None when it is not one."""
    text = (text or "").strip()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    if "%" in text:  # a zone (fe80::1%eth0): never a client on the other side of a proxy
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def forwarded_client(
    peer: str | None, forwarded_for: str, trusted: Sequence[ProxyNetwork]
) -> str | None:
    """The peer, unless it is a trusted proxy; then the rightmost ``X-Forwarded-For`` hop
    that is not one. A hop that is not an address, or trusted hops only, end the walk at
    the nearest address a proxy vouches for: never text the client wrote itself."""
    peer_ip = parse_address(peer)
    if peer_ip is None or not _trusted(peer_ip, trusted):
        return peer
    nearest: Address | None = None
    for hop in reversed(forwarded_for.split(",")):
        ip = parse_address(hop)
        if ip is None:
            break
        if not _trusted(ip, trusted):
            return str(ip)
        if nearest is None:
            nearest = ip
    return str(peer_ip if nearest is None else nearest)


def _trusted(ip: Address, trusted: Sequence[ProxyNetwork]) -> bool:
    return any(ip in network for network in trusted)


class ForwardedClient:
    """Sets the request's client and scheme from ``X-Forwarded-*`` when the peer is a
    trusted proxy, in place of uvicorn's handling; ``trusted`` is read at the first request."""

    def __init__(self, app: ASGIApp, trusted: Callable[[], Sequence[ProxyNetwork]]) -> None:
        self.app = app
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            self._resolve(scope)
        await self.app(scope, receive, send)

    def _resolve(self, scope: Scope) -> None:
        client = scope.get("client")
        peer = str(client[0]) if client else None
        trusted = self.trusted()
        headers = _forwarding_headers(scope)
        if "x-forwarded-for" in headers:
            found = forwarded_client(peer, headers["x-forwarded-for"], trusted)
            if found != peer and found is not None:
                scope["client"] = (found, 0)
        proto = headers.get("x-forwarded-proto", "").strip().lower()
        peer_ip = parse_address(peer)
        if proto in FORWARDED_PROTOS and peer_ip is not None and _trusted(peer_ip, trusted):
            scope["scheme"] = proto.replace("http", "ws") if scope["type"] == "websocket" else proto


def _forwarding_headers(scope: Scope) -> dict[str, str]:
    """``X-Forwarded-For`` (every copy, joined as one list) and ``X-Forwarded-Proto``."""
    found: dict[str, list[str]] = {}
    for name, value in scope.get("headers", []):
        if name in (b"x-forwarded-for", b"x-forwarded-proto"):
            found.setdefault(name.decode(), []).append(value.decode("latin-1"))
    return {name: ",".join(values) for name, values in found.items()}
