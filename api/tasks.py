"""The task routes (docs/design.md, "HTTP API"): create, list, read, retry, cancel, download.

Each route authenticates and calls :mod:`ledger.service` inside one short transaction;
any error rolls it back, so a refused request writes nothing. A creation, the most
frequent request, is two statements on an autocommit connection instead: the token, then
every rule and the insert in one, which also says which rule refused (ledger/creation.py).
Create, retry and cancel
take from their token's rate limit first, reads from its read limit; creations and
retries pass the team's cap on unfinished tasks (``TEAM_MAX_UNFINISHED``), and export
creations its daily export quota, to the ledger, which checks them under a lock
(ledger/quota.py); every refusal answers 429 with ``Retry-After``. Creating a task only
writes its WAITING row: the dispatcher publishes it at once (its insert notifies the
dispatcher), the API never waits on a worker. Visibility is the ledger's: whatever the
caller cannot see answers 404, the same as something missing. Creations and retries take
an ``Idempotency-Key`` (ledger/idempotency.py): sent again with the same request, they
answer what the first did with ``Idempotent-Replayed: true``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Response
from fastapi.responses import RedirectResponse, StreamingResponse
from sqlalchemy.engine import Connection

from api import downloads
from api.cluster import explain_waiting, process_roles_or_none
from api.deps import LimitsDep, ResourcesDep, TokenDep, authenticate
from api.resources import Resources
from api.schemas import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    AcceptedOut,
    ErrorOut,
    ExportRequest,
    ReminderRequest,
    RetriedOut,
    TaskListOut,
    TaskOut,
)
from ledger import service
from ledger.errors import InvalidState
from ledger.idempotency import HEADER as KEY_HEADER
from ledger.idempotency import KeyInUse
from ledger.quota import ExportQuota
from ledger.service import TaskView
from teamdesk.db import autocommit

MSG_NOT_AN_EXPORT = "only export tasks have a CSV"
MSG_NOT_COMPLETED = "the export is not complete yet; its CSV is not available"
# An export that ended without completing never will (a retry is a new run): no "yet".
MSG_NO_CSV = {
    "FAILED": "the export failed; it has no CSV",
    "CANCELLED": "the export was cancelled; it has no CSV",
}
MSG_EXPIRED = "the export's CSV has expired (it is kept 24 hours); create a new export"
CSV_TYPE = "text/csv; charset=utf-8"

# A creation or retry sent again with its Idempotency-Key answers what the first did, with
# this header (ledger/idempotency.py).
REPLAYED_HEADER = "Idempotent-Replayed"
KeyHeader = Annotated[
    str | None,
    Header(
        alias=KEY_HEADER,
        description="a key of your choosing (a new UUID per request): the same request "
        "sent again with it within 24 hours answers what the first did "
        f"({REPLAYED_HEADER}: true) and creates nothing; another request with it "
        "answers 422",
    ),
]

EXPORTS_PATH = "/teams/{team_id}/exports"
REMINDERS_PATH = "/teams/{team_id}/reminders"
# The fields each request body may hold, by route path (for "unknown field" answers).
BODY_FIELDS = {
    "/api" + EXPORTS_PATH: tuple(ExportRequest.model_fields),
    "/api" + REMINDERS_PATH: tuple(ReminderRequest.model_fields),
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    meaning = {
        401: "missing or unknown bearer token",
        403: "not allowed (for example a customer asking for the whole team)",
        404: "not found, or not visible to you (the same answer)",
        409: "the task is not in a state that allows this",
        410: "the CSV has expired or was purged",
        413: "the request body is too large",
        422: "invalid input; nothing was written",
        429: "too many requests (this token's or this address's rate limit, the team's "
        "cap on unfinished tasks or its daily export quota); nothing was written; "
        "Retry-After says when to try again",
        503: "the database (or the export store) is unavailable",
    }
    return {s: {"model": ErrorOut, "description": meaning[s]} for s in (401, *statuses, 429, 503)}


router = APIRouter(prefix="/api", tags=["tasks"])


def _explained(views: list[dict[str, Any]], res: Resources) -> list[dict[str, Any]]:
    """The views with ``waiting_reason`` (api/cluster.py): Redis is read, once, only when
    a task has waited too long, after the transaction ended."""
    explain_waiting(views, lambda: process_roles_or_none(res.redis, res.settings.queue_prefix))
    return views


@router.post(
    EXPORTS_PATH,
    status_code=201,
    response_model=TaskOut,
    summary="Ask for a CSV export of tickets",
    responses=_errors(403, 404, 413, 422),
)
def create_export(
    team_id: uuid.UUID,
    body: ExportRequest,
    response: Response,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
    idempotency_key: KeyHeader = None,
) -> dict[str, Any]:
    settings = res.settings
    quota = ExportQuota.of(settings)
    cap = settings.team_max_unfinished
    with autocommit(res.engine) as conn:  # two round trips, each its own transaction
        caller = authenticate(conn, token)
        limits.throttle_token(caller)
        args = (team_id, caller.user_id, body.scope, body.filters, cap, quota, idempotency_key)
        task = service.submit_export(conn, *args)
    return _created(task, response, res)


def _created(task: TaskView, response: Response, res: Resources) -> dict[str, Any]:
    response.headers["Location"] = f"/api/tasks/{task.id}"
    if task.replayed:
        response.headers[REPLAYED_HEADER] = "true"
    return _explained([task.as_dict()], res)[0]


@router.post(
    REMINDERS_PATH,
    status_code=201,
    response_model=TaskOut,
    summary="Schedule a reminder for a ticket's assignee (staff only)",
    responses=_errors(403, 404, 413, 422),
)
def create_reminder(
    team_id: uuid.UUID,
    body: ReminderRequest,
    response: Response,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
    idempotency_key: KeyHeader = None,
) -> dict[str, Any]:
    cap = res.settings.team_max_unfinished
    with autocommit(res.engine) as conn:  # two round trips, each its own transaction
        caller = authenticate(conn, token)
        limits.throttle_token(caller)
        args = (team_id, caller.user_id, body.ticket_id, body.run_at, cap, idempotency_key)
        task = service.submit_reminder(conn, *args)
    return _created(task, response, res)


@router.get(
    "/teams/{team_id}/tasks",
    response_model=TaskListOut,
    summary="The team's tasks you can see, newest first",
    responses=_errors(404, 422),
)
def list_tasks(
    team_id: uuid.UUID,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = DEFAULT_LIST_LIMIT,
    before: Annotated[
        uuid.UUID | None, Query(description="the last task of the previous page (its `next`)")
    ] = None,
) -> dict[str, Any]:
    with res.engine.begin() as conn:
        caller = authenticate(conn, token)
        limits.throttle_reads(caller)
        views = service.list_tasks(conn, team_id, caller.user_id, limit, before)
    page = _explained([view.as_dict() for view in views], res)
    return {"tasks": page, "next": views[-1].id if len(views) == limit else None}


@router.get(
    "/tasks/{task_id}",
    response_model=TaskOut,
    summary="One task: status, run, attempts, progress, last error, result",
    responses=_errors(404),
)
def get_task(
    task_id: uuid.UUID,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
) -> dict[str, Any]:
    with res.engine.begin() as conn:
        caller = authenticate(conn, token)
        limits.throttle_reads(caller)
        view = service.get_task(conn, task_id, caller.user_id).as_dict()
    return _explained([view], res)[0]


@router.post(
    "/tasks/{task_id}/retry",
    status_code=202,
    response_model=RetriedOut,
    summary="Start a new run of a FAILED or CANCELLED task (accepted, not done); the run "
    "is ready at once, also for a reminder that was scheduled later",
    responses=_errors(403, 404, 409),
)
def retry_task(
    task_id: uuid.UUID,
    response: Response,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
    idempotency_key: KeyHeader = None,
) -> dict[str, Any]:
    cap = res.settings.team_max_unfinished
    quota = ExportQuota.of(res.settings)

    def reopen(conn: Connection, user_id: uuid.UUID) -> tuple[service.Retried, Any]:
        done = service.reopen(conn, task_id, user_id, cap, quota, idempotency_key)
        return done, service.get_task(conn, task_id, user_id).row["run_at"]

    try:
        with res.engine.begin() as conn:
            caller = authenticate(conn, token)
            limits.throttle_token(caller)
            retried, run_at = reopen(conn, caller.user_id)
    except KeyInUse:  # a concurrent retry with the same key committed first: its run
        with res.engine.begin() as conn:
            retried, run_at = reopen(conn, caller.user_id)
    if retried.replayed:
        response.headers[REPLAYED_HEADER] = "true"
    return {"task_id": task_id, "run": retried.run, "status": "WAITING", "run_at": run_at}


@router.post(
    "/tasks/{task_id}/cancel",
    status_code=202,
    response_model=AcceptedOut,
    summary="Cancel a WAITING or RUNNING task; a running execution stops at its next write",
    responses=_errors(404, 409),
)
def cancel_task(
    task_id: uuid.UUID,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
) -> dict[str, Any]:
    with res.engine.begin() as conn:
        caller = authenticate(conn, token)
        limits.throttle_token(caller)
        service.cancel(conn, task_id, caller.user_id)
        run = service.get_task(conn, task_id, caller.user_id).row["run"]
    return {"task_id": task_id, "run": run, "status": "CANCELLED"}


@router.get(
    "/tasks/{task_id}/csv",
    response_class=Response,
    summary="Download a completed export's CSV (kept 24 hours), streamed",
    responses={
        200: {"content": {"text/csv": {"schema": {"type": "string"}}}, "description": "the CSV"},
        307: {
            "description": "EXPORT_DOWNLOAD=redirect with an object store: the CSV is at "
            "the presigned URL in Location, for 60 seconds"
        },
        **_errors(404, 409, 410),
    },
)
def download_csv(
    task_id: uuid.UUID,
    token: TokenDep,
    res: ResourcesDep,
    limits: LimitsDep,
) -> Response:
    with res.engine.begin() as conn:
        caller = authenticate(conn, token)
        limits.throttle_reads(caller)
        task, stored = service.read_csv(conn, task_id, caller.user_id)
    if task["kind"] != "EXPORT":
        raise InvalidState(MSG_NOT_AN_EXPORT)
    if task["status"] != "COMPLETED":
        raise InvalidState(MSG_NO_CSV.get(task["status"], MSG_NOT_COMPLETED))
    if stored is None:
        raise HTTPException(410, MSG_EXPIRED)
    headers = {
        "Content-Disposition": f'attachment; filename="export-{task_id}.csv"',
        "Cache-Control": "no-store",
    }
    location = downloads.object_of(res.engine, stored, caller)
    if location is not None and res.settings.export_download == "redirect":
        target = downloads.redirect_url(location, task_id)
        return RedirectResponse(target, 307, headers={"Cache-Control": "no-store"})
    if not res.downloads.take(caller.token_id):
        raise HTTPException(
            429,
            downloads.MSG_TOO_MANY_DOWNLOADS,
            headers={"Retry-After": str(downloads.RETRY_AFTER_S)},
        )
    body = downloads.start(res.engine, stored, res.downloads, caller, location)
    if body is None:
        raise HTTPException(410, MSG_EXPIRED)
    if stored.size is not None:
        headers["Content-Length"] = str(stored.size)
    return StreamingResponse(body, media_type=CSV_TYPE, headers=headers)
