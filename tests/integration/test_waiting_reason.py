"""A task that waits too long says why (docs/design.md, "Dispatch"): ``waiting_s`` is
measured by the database's clock (its run_at is moved back on the database, no host clock
involved), and once it reaches 5 s ``waiting_reason`` names the missing role; the API's
task view and list, ``teamdesk-tasks status`` and ``watch`` say the same."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from cli.commands.watch import progress_line
from dispatcher.leader import Leadership, leader_key
from harness.factories import World, insert_task
from teamdesk.heartbeat import Heartbeat
from tests.support.api_helpers import bearer

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")

NO_EXPORTS_WORKER = "no worker consumes exports"
NO_DISPATCHER = "no dispatcher is running (start one: celery -A tasks beat)"


def ready_since(engine: sa.Engine, world: World, seconds: int, kind: str = "EXPORT") -> uuid.UUID:
    """A WAITING task that became ready ``seconds`` ago by the database's clock."""
    with engine.begin() as conn:
        task_id = insert_task(conn, world, kind=kind)
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET run_at = now() - make_interval(secs => :s) "
                "WHERE id = :t"
            ),
            {"s": seconds, "t": task_id},
        )
    return task_id


def waiting_fields(client: TestClient, token: str, task_id: uuid.UUID) -> tuple[Any, Any]:
    body = client.get(f"/api/tasks/{task_id}", headers=bearer(token)).json()
    return body["waiting_s"], body["waiting_reason"]


def test_the_api_says_how_long_a_task_waited_and_which_role_is_missing(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    offer: Callable[..., Heartbeat],
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    staff = tokens["staff"]
    late = ready_since(engine, world, 60)
    fresh = ready_since(engine, world, 0)
    with engine.begin() as conn:
        scheduled = insert_task(conn, world, kind="REMINDER")
        conn.execute(
            sa.text("UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :t"),
            {"t": scheduled},
        )
        running = insert_task(conn, world, status="RUNNING")

    seconds, reason = waiting_fields(client, staff, late)
    assert 60 <= seconds <= 65 and reason == NO_EXPORTS_WORKER
    assert waiting_fields(client, staff, fresh) == (0, None)  # not late: no reason yet
    assert waiting_fields(client, staff, scheduled) == (None, None)
    assert waiting_fields(client, staff, running) == (None, None)
    listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=bearer(staff)).json()
    by_id = {t["id"]: (t["waiting_reason"], t["waiting_s"] is None) for t in listed["tasks"]}
    assert by_id == {
        str(late): (NO_EXPORTS_WORKER, False),
        str(fresh): (None, False),
        str(scheduled): (None, True),
        str(running): (None, True),
    }

    offer(queues=("exports",))
    assert waiting_fields(client, staff, late)[1] == NO_DISPATCHER
    leader = Leadership(redis_client, leader_key(queue_prefix), 15)
    assert leader.ensure()
    try:
        seconds, reason = waiting_fields(client, staff, late)
        assert seconds >= 60 and reason is None  # nothing missing: it is in line
    finally:
        leader.release()


def test_status_and_watch_print_the_waiting_line(
    cli: Callable[..., Any], engine: sa.Engine, world: World
) -> None:
    late = ready_since(engine, world, 62)
    result = cli("status", str(late))
    view = json.loads(result.out)
    assert result.code == 0 and view["status"] == "WAITING"
    assert view["waiting_reason"] == NO_EXPORTS_WORKER and 62 <= view["waiting_s"] <= 67
    assert result.err == f"waiting {view['waiting_s']} s: {NO_EXPORTS_WORKER}\n"

    watched = cli("watch", str(late), "--timeout", "0.1", "--interval", "0.05")
    assert watched.code == 3
    lines = set(watched.out.splitlines())
    assert len(lines) == 1
    (line,) = lines
    assert line.startswith("[..........] 0% WAITING run 0 - waiting ")
    assert line.endswith(f" s: {NO_EXPORTS_WORKER}")
    shown = int(line.split(" - waiting ")[1].split(" ")[0])
    assert shown % 5 == 0 and 60 <= shown <= 65  # steps of 5 s: a log gets a line per step


def test_the_watch_line_without_a_wait_is_unchanged() -> None:
    base = {"progress": 40, "status": "RUNNING", "run": 1, "attempts": 2}
    assert progress_line({**base, "waiting_s": None}) == "[####......] 40% RUNNING run 1 attempt 2"
    waiting = {"progress": 0, "status": "WAITING", "run": 0, "attempts": 0}
    assert progress_line({**waiting, "waiting_s": 4}) == "[..........] 0% WAITING run 0"
    assert progress_line({**waiting, "waiting_s": 17, "waiting_reason": None}) == (
        "[..........] 0% WAITING run 0 - waiting 15 s"
    )
