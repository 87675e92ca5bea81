"""The dispatcher loop with a real in-process worker: notifications start work at once, a
scheduled run starts when due, a lost notification costs one scan, the broker holds only
the window, a cancelled run outside the window never reaches a worker, teams take turns,
and a standby takes over from a dead leader without running anything twice.

Interleavings are forced with gates at the code's hook points; the only waits are
``wait_for`` observations with a deadline.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.context import Cluster
from dispatcher.leader import leader_key
from dispatcher.loop import DispatchLoop
from dispatcher.window import MAX_WINDOW_PER_SLOT
from harness.factories import (
    World,
    add_member,
    add_ticket,
    add_tickets,
    add_user,
    audit_events,
    insert_task,
    task_row,
)
from harness.waiting import wait_for
from ledger import service
from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE
from teamdesk import config, hooks
from tests.support.dispatching import listener_backends, running_cluster, running_dispatcher
from tests.support.gates import Gate
from tests.support.queues import queue_key
from tests.support.workers import running_worker

NEVER_S = 3600.0  # a scan interval that never comes round during a test
WAKE_TRIGGER = "background_tasks_wake"


def claim_order(engine: sa.Engine) -> list[uuid.UUID]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT task_id FROM task_audit WHERE event = 'CLAIM' ORDER BY id")
            ).scalars()
        )


def create_export(engine: sa.Engine, team: uuid.UUID, owner: uuid.UUID) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, team, owner, "TEAM", {})


def completed(engine: sa.Engine, task_ids: list[uuid.UUID]) -> bool:
    with engine.connect() as conn:
        done = conn.execute(
            sa.text(
                "SELECT count(*) FROM background_tasks WHERE id = ANY(:ids) "
                "AND status IN ('COMPLETED', 'FAILED', 'CANCELLED')"
            ),
            {"ids": task_ids},
        ).scalar_one()
    return bool(done == len(task_ids))


def test_a_created_task_runs_on_the_notification_alone(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    """No scan comes round: the insert's notification wakes the dispatcher."""
    app = make_app(scan_interval_s=NEVER_S)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    with running_cluster(app) as loop:
        wait_for(lambda: loop.last_scan is not None, what="the first scan")
        task_id = create_export(engine, world.team_id, world.staff_id)
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
        scans = loop.last_scan
    assert scans is not None and scans.dispatched == 0  # the first scan found nothing
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]


def test_a_scheduled_reminder_starts_when_due_by_the_database_clock(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(scan_interval_s=NEVER_S)
    with engine.begin() as conn:
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Call", assignee_id=world.staff_id
        )
        run_at = conn.execute(sa.text("SELECT now() + interval '1.5 seconds'")).scalar_one()
        task_id = service.create_reminder(conn, world.team_id, world.staff_id, ticket, run_at)
    with running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    with engine.connect() as conn:
        claimed_at = conn.execute(
            sa.text("SELECT at FROM task_audit WHERE task_id = :t AND event = 'CLAIM'"),
            {"t": task_id},
        ).scalar_one()
    assert claimed_at >= run_at  # never early; lateness is measured by make bench


def test_a_notification_that_never_arrives_costs_one_scan(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(scan_interval_s=0.5)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
    with running_cluster(app) as loop:
        wait_for(lambda: loop.last_scan is not None, what="the first scan")
        with engine.begin() as conn:  # this insert sends no notification
            conn.execute(
                sa.text("ALTER TABLE background_tasks DISABLE TRIGGER background_tasks_wake")
            )
            task_id = insert_task(conn, world)
            conn.execute(
                sa.text("ALTER TABLE background_tasks ENABLE TRIGGER background_tasks_wake")
            )
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]


def listen_states(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(r, "state", ""))
        for r in caplog.records
        if getattr(r, "event", None) == "dispatcher.listen"
    ]


def test_a_killed_listener_reconnects_and_notifications_work_again(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(scan_interval_s=NEVER_S)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
    with running_cluster(app):
        # Listening, not only connected: a session cut between its connect and its LISTEN
        # logs no first "listening" (a loaded run killed it there).
        wait_for(
            lambda: listen_states(caplog) == ["listening"] and listener_backends(engine) == 1,
            what="the listener to listen",
        )
        killed = listener_backends(engine, terminate=True)
        assert killed == 1
        again = ["listening", "polling", "listening"]
        wait_for(lambda: listen_states(caplog) == again, what="the listener to connect again")
        task_id = create_export(engine, world.team_id, world.staff_id)
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    assert listen_states(caplog) == again


def nothing_to_do_reminders(engine: sa.Engine, world: World, count: int) -> list[uuid.UUID]:
    """Reminders on a resolved ticket: each completes at once, with no side effect."""
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, "Done", status="RESOLVED")
        rows = conn.execute(
            sa.text("""
            INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
            SELECT 'REMINDER', :team, :owner, 'TEAM', jsonb_build_object('ticket_id', :ticket)
              FROM generate_series(1, :n)
            RETURNING id"""),
            {"team": world.team_id, "owner": world.staff_id, "ticket": str(ticket), "n": count},
        )
        return list(rows.scalars())


@contextmanager
def sampling(client: redis.Redis, keys: list[str]) -> Iterator[list[int]]:
    """Sample the total length of ``keys`` every few milliseconds while the block runs."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(sum(int(client.llen(k)) for k in keys))
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(timeout=5)


def test_the_broker_holds_only_the_window_while_a_backlog_drains(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
) -> None:
    app = make_app(scan_interval_s=NEVER_S)
    prefix = config.get_settings().queue_prefix
    rows = nothing_to_do_reminders(engine, world, 2000)
    keys = [queue_key(prefix, EXPORTS_QUEUE), queue_key(prefix, REMINDERS_QUEUE)]
    with sampling(redis_client, keys) as depth, running_cluster(app, concurrency=4) as loop:
        wait_for(lambda: completed(engine, rows), timeout=120, what="the backlog to drain")
        limits = loop.window.slots()
    assert limits == {"exports": 4, "reminders": 4}
    window = MAX_WINDOW_PER_SLOT * 4  # two per process, up to four for short tasks
    assert len(depth) > 100 and 0 < max(depth) <= window
    with engine.connect() as conn:
        claims = conn.execute(
            sa.text("""
            SELECT count(*) FILTER (WHERE event = 'CLAIM'),
                   count(*) FILTER (WHERE event = 'COMPLETE'),
                   count(DISTINCT task_id)
              FROM task_audit WHERE task_id = ANY(:ids)"""),
            {"ids": rows},
        ).one()
    assert tuple(claims) == (2000, 2000, 2000)  # each ran once


def other_team(engine: sa.Engine, name: str) -> tuple[uuid.UUID, uuid.UUID]:
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES (:n) RETURNING id"), {"n": name}
        ).scalar_one()
        staff = add_user(conn, f"Staff {name}")
        add_member(conn, team, staff, "STAFF")
    return team, staff


def test_another_teams_task_takes_the_next_free_slot_ahead_of_a_backlog(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    """One worker process: a window of two messages waiting behind the one running. Team
    A has 10 waiting; A1 runs (parked) and the window holds A's next. B creates one
    export: it takes the window's next free place, ahead of A's backlog, and starts after
    at most what was already waiting (bounded by the window, not by A's backlog)."""
    app = make_app(scan_interval_s=NEVER_S)
    team_b, staff_b = other_team(engine, "B")
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
        add_tickets(conn, team_b, staff_b, 2)
    a_rows = [create_export(engine, world.team_id, world.staff_id) for _ in range(10)]
    first = Gate("A1 running")
    with (
        hooks.installed("export.after_read", first.hook()),
        running_cluster(app, concurrency=1),
    ):
        try:
            first.wait_reached()
            b_task = create_export(engine, team_b, staff_b)
            backlog = [t for t in a_rows if task_row(engine, t)["dispatched_at"] is None]
            assert len(backlog) >= 10 - 1 - 2  # at most A1 and two waiting went out
        finally:
            first.release()
        wait_for(lambda: completed(engine, [*a_rows, b_task]), timeout=60, what="all to end")
    order = claim_order(engine)
    assert set(order) == {*a_rows, b_task}
    assert order.index(b_task) <= 1 + 2, order  # A1, then at most the two waiting
    assert all(order.index(b_task) < order.index(t) for t in backlog), order


def test_a_task_cancelled_outside_the_window_never_reaches_a_worker(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(scan_interval_s=NEVER_S)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
    rows = [create_export(engine, world.team_id, world.staff_id) for _ in range(8)]
    first = Gate("first running")
    with (
        hooks.installed("export.after_read", first.hook()),
        running_cluster(app, concurrency=1),
    ):
        try:
            first.wait_reached()
            outside = [t for t in rows if task_row(engine, t)["dispatched_at"] is None]
            assert len(outside) >= 8 - 1 - 2  # one running, at most two waiting
            with engine.begin() as conn:
                service.cancel(conn, outside[-1], world.staff_id)
        finally:
            first.release()
        wait_for(lambda: completed(engine, rows), timeout=60, what="all to end")
    cancelled = task_row(engine, outside[-1])
    assert (cancelled["status"], cancelled["dispatched_at"]) == ("CANCELLED", None)
    assert audit_events(engine, outside[-1]) == ["CANCEL"]
    assert all(audit_events(engine, t) == ["CLAIM", "COMPLETE"] for t in rows if t != outside[-1])


def test_a_standby_takes_over_from_a_leader_that_died_and_nothing_runs_twice(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
) -> None:
    """Leader A stops without releasing its lock (as if SIGKILLed); standby B takes over
    once the lock expires (5 scan intervals, at least 2 s) and dispatches what was
    created meanwhile. Every task runs exactly once."""
    app = make_app(scan_interval_s=0.4)
    settings = config.get_settings()
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
    before = [create_export(engine, world.team_id, world.staff_id) for _ in range(5)]
    a = DispatchLoop(Cluster(app, settings))
    stop_a = threading.Event()

    def run_a() -> None:
        while not stop_a.is_set():
            pause = a.run_for(0.1)
            if pause:
                stop_a.wait(pause)

    with running_worker(app):
        thread_a = threading.Thread(target=run_a, daemon=True)
        thread_a.start()
        try:
            wait_for(lambda: completed(engine, before), timeout=30, what="A to dispatch")
            with running_dispatcher(app) as b:
                assert not b.leadership.leading
                stop_a.set()  # A dies: no release, no more extensions
                thread_a.join(timeout=10)
                died = time.monotonic()
                after = [create_export(engine, world.team_id, world.staff_id) for _ in range(5)]
                wait_for(lambda: completed(engine, after), timeout=30, what="B to dispatch")
                took_over = time.monotonic() - died
                assert b.leadership.leading
        finally:
            stop_a.set()
            a.cluster.close()
    assert took_over <= a.leadership.ttl_s + 3
    for task_id in before + after:
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    assert not redis_client.exists(leader_key(settings.queue_prefix))  # B released it


def test_the_dispatcher_survives_its_database_connections_being_cut(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    """Every backend of the dispatcher (the pool's and the listener's) is terminated, as a
    failover or an operator would; the loop reports it, reconnects, and dispatches on."""
    app = make_app(scan_interval_s=0.5)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 2)
    with running_cluster(app) as loop:
        first = create_export(engine, world.team_id, world.staff_id)
        wait_for(lambda: completed(engine, [first]), what="the first export")
        # The listener connects after the loop's first round, which may publish and see
        # the first export complete first (a CI run cut before it was there).
        wait_for(lambda: listener_backends(engine) == 1, what="the listener's session")
        with engine.connect() as conn:
            cut = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name LIKE 'teamdesk-dispatcher%' "
                    "AND datname = current_database()"
                )
            ).scalar_one()
        assert cut >= 2  # the pool's connection and the listener
        second = create_export(engine, world.team_id, world.staff_id)
        wait_for(lambda: completed(engine, [second]), what="the export after the cut")
        assert loop.leadership.leading
    assert audit_events(engine, second) == ["CLAIM", "COMPLETE"]
