"""``teamdesk-tasks health --cluster``: can this cluster run my tasks? (docs/design.md, "Dispatch").

Yes when PostgreSQL and Redis answer, a dispatcher leads and every task queue has a live
worker, whether or not work waits. One JSON line on stdout, one sentence per problem on
stderr (api/cluster.py's texts); exit 0 or 1. The per-host probe is plain ``health``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO

import redis
import sqlalchemy as sa

from api.cluster import MSG_NO_REDIS, problems
from dispatcher.process_roles import ProcessRoles, read_process_roles
from ledger.waiting import READY_COUNT_CAP, ready_by_kind, top_ready_teams
from tasks.names import QUEUE_OF_KIND
from teamdesk.config import Settings
from teamdesk.db import bound_transactions, sqlalchemy_url
from teamdesk.failures import database_unusable
from teamdesk.redis_client import redis_client

REDIS_TIMEOUT_S = 1.0
DB_CONNECT_TIMEOUT_S = 2  # libpq takes whole seconds
DB_STATEMENT_TIMEOUT_MS = 2000


def read_cluster_roles(settings: Settings) -> ProcessRoles | None:
    client = redis_client(settings, settings.redis_url, REDIS_TIMEOUT_S)
    try:
        return read_process_roles(client, settings.queue_prefix)
    except redis.RedisError:
        return None
    finally:
        client.close()


Busiest = dict[str, list[dict[str, Any]]]


@dataclass(frozen=True)
class Waiting:
    """What PostgreSQL said about the ready runs, or why it could not be asked."""

    counts: dict[str, int] | None = None  # per task queue
    busiest: Busiest | None = None
    problem: str | None = None  # the sentence naming the cause, when PostgreSQL failed


def read_waiting(database_url: str) -> Waiting:
    """Ready, unpublished runs per task queue and its busiest teams (none for a queue at the
    count's cap); or, when PostgreSQL cannot be used, why."""
    engine = bound_transactions(
        sa.create_engine(
            sqlalchemy_url(database_url),
            poolclass=sa.pool.NullPool,
            connect_args={
                "connect_timeout": DB_CONNECT_TIMEOUT_S,
                "application_name": "teamdesk-health-cluster",
            },
        ),
        DB_STATEMENT_TIMEOUT_MS,
    )
    try:
        with engine.connect() as conn:
            by_kind = ready_by_kind(conn)
            top = top_ready_teams(conn, [k for k, n in by_kind.items() if n < READY_COUNT_CAP])
    except sa.exc.SQLAlchemyError as exc:
        return Waiting(problem=database_unusable(exc))
    finally:
        engine.dispose()
    busiest = {
        QUEUE_OF_KIND[kind]: [{"team_id": str(team), "ready": n} for team, n in teams]
        for kind, teams in top.items()
    }
    return Waiting({QUEUE_OF_KIND[kind]: count for kind, count in by_kind.items()}, busiest)


def cluster_report(roles: ProcessRoles | None, waiting: Waiting) -> dict[str, Any]:
    found = ([] if roles is not None else [MSG_NO_REDIS]) + (
        [waiting.problem] if waiting.problem else []
    )
    fields: dict[str, Any] = {"redis": roles is not None, "database": waiting.problem is None}
    if roles is None:
        fields.update(dispatcher=None, consumers=None, missing=None)
    else:
        fields.update(roles.as_dict())
        found += problems(roles, waiting.counts, READY_COUNT_CAP)
    return {
        **fields,
        "waiting": waiting.counts,
        "busiest_teams": waiting.busiest,
        "problems": found,
    }


def is_able(report: dict[str, Any]) -> bool:
    return bool(report["redis"] and report["database"] and not report["missing"])


def cluster_command(
    settings: Settings, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    report = cluster_report(read_cluster_roles(settings), read_waiting(settings.database_url))
    out.write(json.dumps(report) + "\n")
    for problem in report["problems"]:
        err.write(f"teamdesk-tasks health --cluster: {problem}\n")
    return 0 if is_able(report) else 1
