"""``GET /api/health`` and ``GET /api/workers/health``, bounded by :mod:`api.bounded`
(docs/design.md, "HTTP API" and "Heartbeats"). Answers never carry addresses or error text.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.bounded import CheckFailed
from api.cluster import problems
from api.deps import ResourcesDep
from api.resources import Resources
from api.schemas import HealthOut, WorkersOut
from dispatcher.process_roles import read_process_roles
from teamdesk.heartbeat import live_count
from teamdesk.version import version

CHECK_DEADLINE_S = 2.0
NO_STORE = {"Cache-Control": "no-store"}

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/api", tags=["health"])


def select_one(res: Resources) -> None:
    with res.health_engine.connect() as conn:
        if conn.execute(sa.text("SELECT 1")).scalar_one() != 1:
            raise CheckFailed("unexpected answer")


def cluster_roles(res: Resources) -> dict[str, Any]:
    roles = read_process_roles(res.redis, res.settings.queue_prefix)
    return {
        "workers": live_count(res.redis, res.settings.queue_prefix) > 0,
        **roles.as_dict(),
        "problems": problems(roles),
    }


@router.get(
    "/health",
    response_model=HealthOut,
    summary="Whether the API can reach PostgreSQL",
    description="`SELECT 1` on the database within about 2 s: 200 `ok`, else 503 "
    "`unavailable`; both say the API's running `version`. Does not test Redis, workers or "
    "logins. Concurrent requests share one check, and a pass is reused for up to 1 s (a "
    "failure never is); the answer says `Cache-Control: no-store`.",
    responses={503: {"model": HealthOut, "description": "the database did not answer"}},
)
async def health(res: ResourcesDep) -> JSONResponse:
    try:
        await res.database_check.run(lambda: select_one(res), CHECK_DEADLINE_S)
    except CheckFailed as exc:
        _log_failure("database", exc)
        return JSONResponse(health_body("unavailable"), status_code=503, headers=NO_STORE)
    return JSONResponse(health_body("ok"), headers=NO_STORE)


def health_body(status: Literal["ok", "unavailable"]) -> dict[str, str]:
    """``{"status", "version"}``: which build answered, even when it is unavailable."""
    return {"status": status, "version": version()}


@router.get(
    "/workers/health",
    response_model=WorkersOut,
    summary="Whether the cluster's process roles are alive",
    description="`workers` is true when at least one worker heartbeat is live; `dispatcher` "
    "when a dispatcher (beat) holds the leader lock; `consumers` counts live worker "
    "processes per task queue; `missing` names the roles the cluster lacks (tasks of a "
    "queue nobody consumes, or any task when there is no dispatcher, wait until they "
    'return) and `problems` says the same in words ("no worker consumes exports"). 503 '
    "with `workers: null` when Redis cannot be read within about 2 s. Read "
    "afresh for every request; concurrent requests share one read. Never cached.",
    responses={503: {"model": WorkersOut, "description": "Redis could not be read"}},
)
async def workers_health(res: ResourcesDep) -> JSONResponse:
    try:
        roles = await res.roles_check.run(lambda: cluster_roles(res), CHECK_DEADLINE_S)
    except CheckFailed as exc:
        _log_failure("redis", exc)
        return JSONResponse({"workers": None}, status_code=503, headers=NO_STORE)
    return JSONResponse(roles, headers=NO_STORE)


def _log_failure(check: str, exc: CheckFailed) -> None:
    cause: Any = exc.__cause__
    error = type(cause).__name__ if cause is not None else str(exc)
    logger.warning("health check failed", extra={"check": check, "error": error})
