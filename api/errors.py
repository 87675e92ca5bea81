"""Errors as HTTP answers, always ``{"detail": "<fixed message>"}`` (docs/design.md, "HTTP API").

Validation answers never echo the input or pydantic's text; a task route checks the token
before judging the request (401 before 422). Logs carry the error class only, never SQL
parameters (they hold request bodies).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg2
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from api.deps import client_address, limits, resources, token_is_valid, unauthenticated
from api.schemas import MAX_LIST_LIMIT
from api.tasks import BODY_FIELDS
from ledger import service
from ledger.errors import (
    ExportQuotaExceeded,
    InvalidInput,
    InvalidState,
    LedgerError,
    NotAllowed,
    NotFound,
    TaskRejected,
    TeamQuotaExceeded,
)
from ledger.filters import MSG_NOT_OBJECT
from teamdesk.export_store import ObjectStoreError

MSG_TEAM_NOT_FOUND = "Team not found."
MSG_TASK_NOT_FOUND = NotFound().message
MSG_UNAVAILABLE = "the service is temporarily unavailable; try again shortly"
MSG_BODY_JSON = "the request body must be a JSON object"
MSG_BODY_NOT_JSON = "the request body is not valid JSON"
MSG_CONTENT_TYPE = "send the request body as JSON, with Content-Type: application/json"
MSG_INVALID = "the request is invalid; see /docs for the expected form"
MSG_LIMIT = f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}"

PROTECTED_PREFIXES = ("/api/teams/", "/api/tasks/")  # authenticated before anything is judged

FIELD_MESSAGES = {
    ("body", "scope"): service.MSG_SCOPE,
    ("body", "filters"): MSG_NOT_OBJECT,
    ("body", "ticket_id"): service.MSG_TICKET,
    ("body", "run_at"): service.MSG_RUN_AT,
    ("query", "limit"): MSG_LIMIT,
}
NOT_FOUND_PATH = {"team_id": MSG_TEAM_NOT_FOUND, "task_id": MSG_TASK_NOT_FOUND}

TEAM_FULL_RETRY_AFTER_S = 60  # tasks take seconds to minutes to finish

STATUS_BY_ERROR: tuple[tuple[type[LedgerError], int], ...] = (
    (TeamQuotaExceeded, 429),
    (ExportQuotaExceeded, 429),
    (NotFound, 404),
    (NotAllowed, 403),
    (InvalidState, 409),
    (InvalidInput, 422),
    (TaskRejected, 422),  # InvalidFilters
)

# psycopg2's own too: the hot-path statements go straight to the driver (ledger/prepared.py).
UNAVAILABLE_ERRORS = (
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.TimeoutError,
    sqlalchemy.exc.DisconnectionError,
    psycopg2.OperationalError,
    psycopg2.InterfaceError,
)

logger = logging.getLogger(__name__)


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def status_for(exc: LedgerError) -> int:
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


async def ledger_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LedgerError)
    headers = None
    if isinstance(exc, TeamQuotaExceeded):
        headers = {"Retry-After": str(TEAM_FULL_RETRY_AFTER_S)}
    elif isinstance(exc, ExportQuotaExceeded):
        headers = {"Retry-After": str(exc.retry_after_s)}
    return error(status_for(exc), exc.message, headers=headers)


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    logger.warning(
        "database unavailable", extra={"error": type(exc).__name__, "path": _route_path(request)}
    )
    return error(503, MSG_UNAVAILABLE, headers={"Retry-After": "5"})


async def store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The export store (an S3-compatible object store) failed: the same 503 as the
    database's, its cause logged (the error's class and the store's code, no key)."""
    logger.warning(
        "export store unavailable",
        extra={"error": type(exc).__name__, "cause": str(exc), "path": _route_path(request)},
    )
    return error(503, MSG_UNAVAILABLE, headers={"Retry-After": "5"})


async def invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    status, message = validation_answer(exc.errors(), _route_path(request))
    if message == MSG_BODY_JSON and not _says_json(request):
        message = MSG_CONTENT_TYPE  # the usual cause: curl -d without -H "Content-Type: ..."
    return await _unless_unauthenticated(request, error(status, message))


def _says_json(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer, except a body it could not even decode (not UTF-8, nested too
    deep): that is invalid input like any malformed JSON, so 422 (after authentication)."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and exc.__cause__ is not None:
        return await _unless_unauthenticated(request, error(422, MSG_BODY_NOT_JSON))
    if exc.status_code == 401:
        return await _authentication_failed(request, exc)
    return await http_exception_handler(request, exc)


async def _unless_unauthenticated(request: Request, answer: JSONResponse) -> Response:
    """``answer``, or 401 when a task route was called without a live token (429 when
    the address may not try any more)."""
    if request.url.path.startswith(PROTECTED_PREFIXES):
        try:
            known = await run_in_threadpool(token_is_valid, resources(request), request)
        except UNAVAILABLE_ERRORS as db_exc:
            return await database_unavailable(request, db_exc)
        if not known:
            return await _authentication_failed(request, unauthenticated())
    return answer


async def _authentication_failed(request: Request, denied: StarletteHTTPException) -> Response:
    """A request without a live token takes one failed authentication from its address's
    budget: 401, or 429 once the budget is spent. Only such requests ever do: a live
    token is never refused for what other clients of its address did."""
    try:
        await run_in_threadpool(limits(request).count_auth_failure, client_address(request))
    except StarletteHTTPException as refused:
        return await http_exception_handler(request, refused)
    return await http_exception_handler(request, denied)


def validation_answer(errors: Sequence[Any], route_path: str) -> tuple[int, str]:
    """The status and fixed message for pydantic errors: a bad path id first, then the rest."""
    locs = [tuple(err.get("loc", ())) for err in errors]
    for loc in locs:
        if len(loc) >= 2 and loc[0] == "path" and loc[1] in NOT_FOUND_PATH:
            return 404, NOT_FOUND_PATH[str(loc[1])]
    if not errors:
        return 422, MSG_INVALID
    return 422, _field_message(errors[0].get("type", ""), locs[0], route_path)


def _field_message(kind: str, loc: tuple[Any, ...], route_path: str) -> str:
    if loc[:1] == ("body",) and kind == "json_invalid":
        return MSG_BODY_NOT_JSON
    if loc[:1] == ("body",) and len(loc) == 1:
        return MSG_BODY_JSON
    if kind == "extra_forbidden" and loc[:1] == ("body",):
        allowed = BODY_FIELDS.get(route_path)
        if allowed:
            return f"the request body may only contain {', '.join(allowed)}"
    return FIELD_MESSAGES.get(
        (str(loc[0]), str(loc[1])) if len(loc) >= 2 else ("", ""), MSG_INVALID
    )


def _route_path(request: Request) -> str:
    route = request.scope.get("route")
    return str(getattr(route, "path", ""))


def install(app: FastAPI) -> None:
    app.add_exception_handler(LedgerError, ledger_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for cls in UNAVAILABLE_ERRORS:
        app.add_exception_handler(cls, database_unavailable)
    app.add_exception_handler(ObjectStoreError, store_unavailable)
