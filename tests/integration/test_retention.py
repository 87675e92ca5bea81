"""Retention (ledger/retention.py, run by the dispatcher's purge step): finished tasks and
audit rows past their retention are removed in bounded batches; everything younger, and
every unfinished task, stays; a notification outlives its task."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from celery import Celery

from dispatcher.scan import run_once
from harness.factories import World, add_ticket, insert_task, task_row
from ledger import lease, retention
from ledger.retention import Retention, purge_retired

DAY_S = 86_400


def finished_task(engine: sa.Engine, world: World, kind: str = "EXPORT") -> uuid.UUID:
    """A task claimed and completed through the ledger (so it has its audit trail)."""
    with engine.begin() as conn:
        filters = {}
        if kind == "REMINDER":
            ticket = add_ticket(conn, world.team_id, world.customer_id)
            filters = {"ticket_id": str(ticket)}
        task_id = insert_task(conn, world, kind=kind, filters=filters)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        claimed = lease.claim(conn, task_id, 0)
        assert claimed is not None
        if kind == "REMINDER":
            conn.execute(
                sa.text(
                    "INSERT INTO notifications (user_id, ticket_id, task_id) VALUES (:u, :t, :id)"
                ),
                {"u": world.staff_id, "t": ticket, "id": task_id},
            )
        lease.complete_export(conn, claimed.lease, "id\n", "0 rows")
    return task_id


def age(engine: sa.Engine, task_id: uuid.UUID, days: float) -> None:
    """Move the task's last change and its audit trail ``days`` into the past."""
    with engine.begin() as conn:
        params = {"s": days * DAY_S, "id": task_id}
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET updated_at = updated_at - make_interval(secs => :s),"
                " created_at = created_at - make_interval(secs => :s) WHERE id = :id"
            ),
            params,
        )
        conn.execute(
            sa.text(
                "UPDATE task_audit SET at = at - make_interval(secs => :s) WHERE task_id = :id"
            ),
            params,
        )


def audit_rows(engine: sa.Engine, task_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM task_audit WHERE task_id = :id"), {"id": task_id}
            ).scalar_one()
        )


def exists(engine: sa.Engine, task_id: uuid.UUID) -> bool:
    with engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT 1 FROM background_tasks WHERE id = :id"), {"id": task_id}
        ).first()
    return found is not None


def test_the_purge_removes_old_finished_tasks_with_their_trail_and_keeps_the_rest(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    old = finished_task(engine, world)
    old_reminder = finished_task(engine, world, kind="REMINDER")
    recent = finished_task(engine, world)
    with engine.begin() as conn:
        waiting = insert_task(conn, world)  # unfinished, however old
    for task_id in (old, old_reminder, waiting):
        age(engine, task_id, retention.TASK_RETENTION_DAYS + 1)

    counts = run_once(celery_app)

    # The old trails went first (past the audit retention), then their tasks.
    assert (counts.retired_tasks, counts.retired_audit) == (2, 4)
    assert not exists(engine, old) and not exists(engine, old_reminder)
    assert audit_rows(engine, old) == 0 and audit_rows(engine, old_reminder) == 0
    assert exists(engine, recent) and audit_rows(engine, recent) == 2  # CLAIM, COMPLETE
    assert task_row(engine, waiting)["status"] == "WAITING"
    with engine.connect() as conn:  # the notification is the user's: it stays
        notes = conn.execute(
            sa.text("SELECT task_id FROM notifications WHERE user_id = :u"),
            {"u": world.staff_id},
        ).all()
    assert [n.task_id for n in notes] == [None]


def test_audit_rows_past_their_retention_go_oldest_first_in_bounded_batches(
    engine: sa.Engine, world: World
) -> None:
    kept_task = finished_task(engine, world)
    first, second = finished_task(engine, world), finished_task(engine, world)
    for task_id in (first, second):  # trails past the audit retention, tasks kept
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE task_audit SET at = at - make_interval(days => 40) WHERE task_id = :id"
                ),
                {"id": task_id},
            )
    keep = Retention(task_days=365, audit_days=30)
    with engine.begin() as conn:  # the head of the trail: kept_task's two rows come first
        assert purge_retired(conn, keep, batch=3) == retention.Purged(tasks=0, audit=1)
    with engine.begin() as conn:
        assert purge_retired(conn, keep, batch=100) == retention.Purged(tasks=0, audit=3)
    assert (audit_rows(engine, first), audit_rows(engine, second)) == (0, 0)
    assert audit_rows(engine, kept_task) == 2
    assert exists(engine, first) and exists(engine, second)


def test_nothing_younger_than_a_day_is_removed_whatever_the_retention_asks(
    engine: sa.Engine, world: World
) -> None:
    task_id = finished_task(engine, world)
    age(engine, task_id, 0.5)
    with engine.begin() as conn:
        purged = purge_retired(conn, Retention(task_days=0, audit_days=0), batch=100)
    assert purged == retention.Purged(tasks=0, audit=0)
    assert exists(engine, task_id) and audit_rows(engine, task_id) == 2
