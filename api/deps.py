"""Route plumbing: the app's resources, bearer authentication and the rate limits
(docs/design.md, "HTTP API", abuse limits).

A route reads the raw token (:func:`bearer_token`, no database), then resolves it in its
own transaction (:func:`authenticate`). Tokens are never logged or echoed.
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Connection

from api.limits import RateLimiter, Rule, Verdict
from api.middleware import parse_address
from api.resources import Resources
from ledger.tokens import TokenOwner, resolve_token

MSG_UNAUTHENTICATED = "a valid bearer token is required (Authorization: Bearer <token>)"
MSG_TOKEN_RATE = "too many requests with this token; try again after Retry-After seconds"
MSG_READ_RATE = "too many reads with this token; try again after Retry-After seconds"
MSG_AUTH_RATE = (
    "too many failed authentications from this address; try again after Retry-After seconds"
)
UNKNOWN_ADDRESS = "unknown"
READ_METHODS = frozenset({"GET", "HEAD"})  # every other task route writes

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token (`teamdesk-tasks token create USER`).",
)
_limits_lock = threading.Lock()


@dataclass(frozen=True)
class Limits:
    """The app's rate limits: one limiter (state in Redis) and the rules it applies."""

    limiter: RateLimiter
    per_token: Rule
    auth_failures: Rule
    reads: Rule

    def count_auth_failure(self, address: str) -> None:
        """Take one failed authentication from ``address``'s budget; 429 when it is spent."""
        _refuse(self.limiter.take(self.auth_failures, auth_subject(address)), MSG_AUTH_RATE)

    def throttle_token(self, owner: TokenOwner) -> None:
        """429 when the token's budget for create, retry and cancel is spent."""
        _refuse(self.limiter.take(self.per_token, str(owner.token_id)), MSG_TOKEN_RATE)

    def throttle_reads(self, owner: TokenOwner) -> None:
        """429 when the token's budget for reads (a task, a list, a CSV) is spent."""
        _refuse(self.limiter.take(self.reads, str(owner.token_id)), MSG_READ_RATE)

    def throttle_method(self, owner: TokenOwner, method: str) -> None:
        """The budget a request of ``method`` takes from when no route ran to say (its
        path or body was invalid): reads for GET and HEAD, the token's for the rest."""
        if method.upper() in READ_METHODS:
            self.throttle_reads(owner)
        else:
            self.throttle_token(owner)


def _refuse(verdict: Verdict, message: str) -> None:
    if not verdict.allowed:
        raise HTTPException(429, message, headers={"Retry-After": str(verdict.retry_after_s)})


def resources(request: Request) -> Resources:
    app_resources: Resources = request.app.state.resources
    return app_resources


def limits(request: Request) -> Limits:
    """The app's :class:`Limits`, built on first use from its settings (its Redis client
    is the resources', opened lazily and closed with them)."""
    state = request.app.state
    with _limits_lock:
        found: Limits | None = getattr(state, "limits", None)
        if found is None:
            res = resources(request)
            settings = res.settings
            found = Limits(
                RateLimiter(lambda: res.redis, settings.queue_prefix),
                Rule("token", settings.api_rate_per_min, settings.api_rate_burst),
                Rule("auth", settings.auth_failures_per_min, settings.auth_failures_per_min),
                Rule("read", settings.api_read_rate_per_min, settings.api_read_burst),
            )
            state.limits = found
    return found


IPV6_CLIENT_PREFIX = 64


def auth_subject(address: str) -> str:
    """Whose budget a failed authentication takes from: the address, an IPv6 address's
    /64, a 6to4 or Teredo address's embedded IPv4 (one IPv4 host holds 65,536 /64s
    there), :data:`UNKNOWN_ADDRESS` for anything else: client text never names a bucket."""
    ip = parse_address(address)
    if ip is None:
        return UNKNOWN_ADDRESS
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            return str(embedded)
        return str(ipaddress.ip_network(f"{ip}/{IPV6_CLIENT_PREFIX}", strict=False))
    return str(ip)


def client_address(request: Request) -> str:
    """The client's address: the peer, or behind trusted proxies (``FORWARDED_ALLOW_IPS``
    must name them) what :class:`api.middleware.ForwardedClient` found."""
    return request.client.host if request.client else UNKNOWN_ADDRESS


def unauthenticated() -> HTTPException:
    return HTTPException(401, MSG_UNAUTHENTICATED, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The raw token from ``Authorization: Bearer``; 401 when the header is missing."""
    if credentials is None or not credentials.credentials:
        raise unauthenticated()
    return credentials.credentials


ResourcesDep = Annotated[Resources, Depends(resources)]
TokenDep = Annotated[str, Depends(bearer_token)]
LimitsDep = Annotated[Limits, Depends(limits)]


def authenticate(conn: Connection, token: str) -> TokenOwner:
    """The live token and its user; 401 for an unknown, expired or revoked token."""
    owner = resolve_token(conn, token)
    if owner is None:
        raise unauthenticated()
    return owner


def token_is_valid(res: Resources, request: Request) -> bool:
    """Whether the request carries a live token (for answering 401 before 422).

    A live token's request takes from its route's budget here too, as if the route had
    run; HTTPException 429 once that is spent (api/app.py answers it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    with res.engine.begin() as conn:
        owner = resolve_token(conn, token.strip())
    if owner is None:
        return False
    limits(request).throttle_method(owner, request.method)
    return True
