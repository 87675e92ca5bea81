"""Helpers for the dispatcher scan tests (tests/integration/test_dispatch_{window,stamping,
recovery}.py): WAITING and RUNNING rows made through the ledger, the messages each queue's
Redis list holds, and an injected age of the heartbeat record that trusts it. The worker
window those scans fill is the ``offer`` fixture (tests/integration/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.context import Cluster
from dispatcher.scan import ScanCounts, scan
from dispatcher.window import Window
from harness.factories import World, add_member, add_user, insert_task
from ledger import lease
from teamdesk.config import get_settings
from tests.support.queues import all_task_messages, message_ids

LONG_UP = 3600.0  # an injected heartbeat-record age well past HEARTBEAT_TTL_S


def long_up(_client: redis.Redis) -> float:
    return LONG_UP


@contextmanager
def dispatcher(app: Celery, **overrides: Any) -> Iterator[Callable[[], ScanCounts]]:
    """Scans of one dispatcher: one cluster and one window, remembered between scans (a
    message is judged lost only when two looks a scan apart miss it). No team cap unless
    ``team_max_running`` is given."""
    overrides.setdefault("team_max_running", 0)
    cluster = Cluster(app, get_settings().with_overrides(**overrides))
    window = Window(cluster)
    try:
        yield lambda: scan(cluster, window, uptime=long_up)
    finally:
        cluster.close()


def waiting_rows(
    engine: sa.Engine, world: World, count: int, kind: str = "EXPORT", **kw: Any
) -> list[uuid.UUID]:
    """``count`` WAITING rows, each created (and ready) in its own transaction, so their
    ``run_at`` (the database's now()) order is their creation order."""
    rows = []
    for _ in range(count):
        with engine.begin() as conn:
            rows.append(insert_task(conn, world, kind=kind, **kw))
    return rows


def other_team(engine: sa.Engine, name: str) -> World:
    """A second team with its own staff member, as a World for insert_task."""
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES (:n) RETURNING id"), {"n": name}
        ).scalar_one()
        staff = add_user(conn, f"Staff {name}")
        add_member(conn, team, staff, "STAFF")
    return World(team, staff, staff, staff, staff)


def running_row(
    engine: sa.Engine,
    world: World,
    holder: str | None = None,
    recoveries: int = 0,
    kind: str = "EXPORT",
) -> uuid.UUID:
    """A row claimed by a real claim (lease and holder set), then given ``recoveries``."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world, kind=kind)
        assert lease.claim(conn, task_id, 0, holder) is not None
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET recoveries = :r, dispatched_at = now() WHERE id = :id"
            ),
            {"r": recoveries, "id": task_id},
        )
    return task_id


def ids(task_ids: list[uuid.UUID], run: int = 0) -> list[str]:
    return message_ids((t, run) for t in task_ids)


def messages(redis_client: redis.Redis, prefix: str) -> dict[str, list[str]]:
    return {q: sorted(v) for q, v in all_task_messages(redis_client, prefix).items()}
