"""Request plumbing shared by the routes: the app's resources and bearer authentication.

A route reads the raw token from the header (:func:`bearer_token`, no database), then
resolves it inside its own transaction (:func:`authenticate`), so every task route is
one short transaction. Tokens are never logged or echoed.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Connection

from api.resources import Resources
from ledger.tokens import user_for_token

MSG_UNAUTHENTICATED = "a valid bearer token is required (Authorization: Bearer <token>)"

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token (`teamdesk-tasks token create USER`).",
)


def resources(request: Request) -> Resources:
    app_resources: Resources = request.app.state.resources
    return app_resources


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


def authenticate(conn: Connection, token: str) -> uuid.UUID:
    """The token's user; 401 for an unknown token."""
    user_id = user_for_token(conn, token)
    if user_id is None:
        raise unauthenticated()
    return user_id


def token_is_valid(res: Resources, request: Request) -> bool:
    """Whether the request carries a known token (for answering 401 before 422)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    with res.engine.begin() as conn:
        return user_for_token(conn, token.strip()) is not None
