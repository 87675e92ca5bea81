"""The dispatcher's scan and fill (docs/design.md, "Dispatch") against real PostgreSQL
and the real Redis broker, with no worker consuming: every message a scan publishes
stays in its queue's Redis list, where the test reads it back by id. Worker window
comes from heartbeat members the test registers itself. Concurrency is ordered by a
barrier inside the ledger call, never by sleeping.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher import scan as scan_module
from dispatcher.context import Cluster
from dispatcher.heartbeat import Heartbeat, WorkerSlots
from dispatcher.scan import ScanCounts, run_once
from dispatcher.window import Window, fill
from ledger import dispatch, lease
from teamdesk.config import Settings
from tests.support.factories import (
    World,
    add_member,
    add_user,
    age_task,
    insert_task,
    task_row,
)
from tests.support.queues import all_task_messages, closed_port, markers, message_ids

LONG_UP = 3600.0  # an injected Redis uptime well past HEARTBEAT_TTL_S


def long_up(_client: redis.Redis) -> float:
    return LONG_UP


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


def set_columns(engine: sa.Engine, task_id: uuid.UUID, **values: Any) -> None:
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignments} WHERE id = :id"),
            {"id": task_id, **values},
        )


def shift(engine: sa.Engine, task_id: uuid.UUID, column: str, seconds: float) -> None:
    """Move a timestamp into the past by the database's clock (no waiting)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE background_tasks SET {column} = {column} - make_interval(secs => :s) "
                "WHERE id = :id"
            ),
            {"s": seconds, "id": task_id},
        )


def ids(task_ids: list[uuid.UUID], run: int = 0) -> list[str]:
    return message_ids((t, run) for t in task_ids)


def messages(redis_client: redis.Redis, prefix: str) -> dict[str, list[str]]:
    return {q: sorted(v) for q, v in all_task_messages(redis_client, prefix).items()}


def stamp_of(engine: sa.Engine, task_id: uuid.UUID) -> str:
    stamp = task_row(engine, task_id)["dispatched_at"]
    assert stamp is not None
    return str(stamp.isoformat())


@pytest.fixture
def offer(
    redis_client: redis.Redis, queue_prefix: str, settings: Settings
) -> Iterator[Callable[..., Heartbeat]]:
    """Register a live worker process offering ``concurrency`` slots on ``queues``."""
    members: list[Heartbeat] = []

    def register(
        concurrency: int = 10, queues: tuple[str, ...] = ("exports", "reminders")
    ) -> Heartbeat:
        member = Heartbeat(
            redis_client,
            queue_prefix,
            "test-host",
            settings.heartbeat_ttl_s,
            WorkerSlots(queues, concurrency),
        )
        assert member.renew()
        members.append(member)
        return member

    yield register
    for member in members:
        member.remove()


# --- fill: publish ready runs into the window ----------------------------------------------


def test_scan_publishes_each_ready_run_once_with_its_message_id_and_a_stamped_marker(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    offer()
    exports = waiting_rows(engine, world, 2)
    reminders = waiting_rows(engine, world, 1, kind="REMINDER")
    later_one = waiting_rows(engine, world, 1, kind="REMINDER")[0]
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :i"),
            {"i": later_one},
        )
    retried = waiting_rows(engine, world, 1, run=1)[0]
    done = running_row(engine, world)
    set_columns(engine, done, status="COMPLETED", execution_id=None, dispatched_at=None)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.dispatched, counts.redispatched, counts.publish_failed) == (4, 0, 0)
    assert counts.next_due_s is not None and 3500 < counts.next_due_s <= 3600
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }
    published = [*exports, *reminders, retried]
    for task_id in published:
        row = task_row(engine, task_id)
        run = row["run"]
        assert row["status"] == "WAITING" and row["dispatched_at"] is not None
        marker = redis_client.get(f"{queue_prefix}:queued:{task_id}-{run}")
        assert marker is not None and marker == stamp_of(engine, task_id)
    assert task_row(engine, later_one)["dispatched_at"] is None
    assert task_row(engine, done)["dispatched_at"] is None

    again = run_once(celery_app, uptime=long_up)

    assert (again.dispatched, again.redispatched) == (0, 0)
    assert messages(redis_client, queue_prefix) == {
        "exports": sorted([*ids(exports), f"{retried}-1"]),
        "reminders": ids(reminders),
    }


def test_the_window_holds_two_runs_per_worker_process_and_refills_as_they_are_claimed(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    worker = offer(concurrency=2, queues=("exports",))  # window: 4 exports waiting
    rows = waiting_rows(engine, world, 10)

    first = run_once(celery_app, uptime=long_up)

    assert first.dispatched == 4
    published = [t for t in rows if task_row(engine, t)["dispatched_at"] is not None]
    assert len(published) == 4
    assert messages(redis_client, queue_prefix)["exports"] == ids(sorted(published, key=str))
    assert run_once(celery_app, uptime=long_up).dispatched == 0  # full
    with engine.begin() as conn:  # two are claimed: they left the window
        held = [lease.claim(conn, t, 0, worker.member) for t in published[:2]]
    assert all(held)
    assert run_once(celery_app, uptime=long_up).dispatched == 2
    assert sum(task_row(engine, t)["dispatched_at"] is not None for t in rows) == 6
    assert len(messages(redis_client, queue_prefix)["exports"]) == 6  # no worker took any


def test_dispatch_window_setting_overrides_the_heartbeat_sizing(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    app = make_app(dispatch_window=3)
    waiting_rows(engine, world, 5)
    waiting_rows(engine, world, 5, kind="REMINDER")

    counts = run_once(app, uptime=long_up)  # no worker registered at all

    assert counts.dispatched == 6
    got = messages(redis_client, queue_prefix)
    assert (len(got["exports"]), len(got["reminders"])) == (3, 3)
    assert counts.no_consumers == ["exports", "reminders"]


def test_a_queue_no_live_worker_consumes_gets_no_messages_and_the_scan_says_so(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    offer(concurrency=2, queues=("exports",))
    exports = waiting_rows(engine, world, 1)
    reminders = waiting_rows(engine, world, 1, kind="REMINDER")

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.dispatched, counts.no_consumers) == (1, ["reminders"])
    assert messages(redis_client, queue_prefix) == {"exports": ids(exports), "reminders": []}
    assert task_row(engine, reminders[0])["dispatched_at"] is None
    assert "no live worker consumes reminders" in counts.summary()


def other_team(engine: sa.Engine, name: str) -> World:
    """A second team with its own staff member, as a World for insert_task."""
    with engine.begin() as conn:
        team = conn.execute(
            sa.text("INSERT INTO teams (name) VALUES (:n) RETURNING id"), {"n": name}
        ).scalar_one()
        staff = add_user(conn, f"Staff {name}")
        add_member(conn, team, staff, "STAFF")
    return World(team, staff, staff, staff, staff)


def stamped_order(engine: sa.Engine, refs: list[dispatch.RunRef]) -> list[uuid.UUID]:
    return [ref.task_id for ref in refs]


def expected_turn(
    waiting: dict[uuid.UUID, list[uuid.UUID]], cursor: uuid.UUID, n: int
) -> list[uuid.UUID]:
    """The round-robin rule, written plainly: starting after ``cursor`` in team id order
    and wrapping, the next ``n`` teams with waiting rows each give their oldest; with
    fewer teams than ``n``, each gives its next oldest in the same order, and so on."""
    teams = sorted((t for t, rows in waiting.items() if rows), key=lambda t: (t <= cursor, t))
    turn, left = teams[:n], {t: list(waiting[t]) for t in teams[:n]}
    picked: list[uuid.UUID] = []
    while len(picked) < n and any(left.values()):
        for team in turn:
            if left[team] and len(picked) < n:
                picked.append(left[team].pop(0))
    return picked


def test_teams_take_turns_round_robin_from_where_the_last_turn_ended(
    engine: sa.Engine, world: World
) -> None:
    """Team A queued 20 first, then C 2, then B 1: every turn serves the next teams after
    the one served last, one run each, so one team's backlog never stands in front of
    another team's first task."""
    team_a, team_b, team_c = world, other_team(engine, "B"), other_team(engine, "C")
    waiting = {
        team_a.team_id: waiting_rows(engine, team_a, 20),
        team_c.team_id: waiting_rows(engine, team_c, 2),
        team_b.team_id: waiting_rows(engine, team_b, 1),
    }
    cursor = dispatch.NO_TEAM
    for n in (2, 2, 2, 3):
        want = expected_turn(waiting, cursor, n)
        with engine.begin() as conn:
            turn = dispatch.stamp_ready(conn, kind="EXPORT", n=n, team_cap=0, cursor=cursor)
        assert stamped_order(engine, turn.refs) == want
        for rows in waiting.values():
            rows[:] = [r for r in rows if r not in want]
        cursor = turn.cursor
    assert waiting[team_b.team_id] == [] and waiting[team_c.team_id] == []
    assert len(waiting[team_a.team_id]) == 20 - 6  # B's one and C's two went in A's turns


def test_a_team_with_only_scheduled_runs_does_not_hold_up_a_turn(
    engine: sa.Engine, world: World
) -> None:
    """The team first in line has nothing ready (its reminder is due in an hour); the
    turn passes it over and serves the next team's ready run."""
    teams = sorted([world, other_team(engine, "B")], key=lambda team: team.team_id)
    first, second = teams
    scheduled = waiting_rows(engine, first, 1)[0]
    set_columns_sql(engine, scheduled, "run_at = now() + interval '1 hour'")
    ready = waiting_rows(engine, second, 1)[0]

    with engine.begin() as conn:
        turn = dispatch.stamp_ready(conn, kind="EXPORT", n=1, team_cap=0)

    assert stamped_order(engine, turn.refs) == [ready]
    assert turn.cursor == second.team_id
    assert task_row(engine, scheduled)["dispatched_at"] is None


def set_columns_sql(engine: sa.Engine, task_id: uuid.UUID, assignment: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE background_tasks SET {assignment} WHERE id = :id"), {"id": task_id}
        )


def test_team_cap_limits_one_team_in_flight(engine: sa.Engine, world: World) -> None:
    team_b = other_team(engine, "B")
    a_rows = waiting_rows(engine, world, 10)
    b_rows = waiting_rows(engine, team_b, 10)

    with engine.begin() as conn:
        stamped = dispatch.stamp_ready(conn, kind="EXPORT", n=10, team_cap=2).refs

    assert sorted(stamped_order(engine, stamped)) == sorted(a_rows[:2] + b_rows[:2])
    with engine.begin() as conn:
        assert dispatch.stamp_ready(conn, kind="EXPORT", n=10, team_cap=2).refs == []


def test_overlapping_fills_never_stamp_or_publish_a_run_twice(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    settings: Settings,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two dispatchers overlap (a standby taking over): both select while the other holds
    its row locks. SKIP LOCKED: the second takes fewer rows, never a row twice."""
    offer(concurrency=20)
    rows = waiting_rows(engine, world, 30)
    both_inside = threading.Barrier(2, timeout=20)
    stamped: list[list[dispatch.RunRef]] = []
    real = dispatch.stamp_ready

    def stamp_then_wait(conn: sa.Connection, **kw: Any) -> dispatch.Turn:
        turn = real(conn, **kw)
        if kw["kind"] == "EXPORT":
            stamped.append(turn.refs)
            both_inside.wait()  # both fills hold their locks at the same time
        return turn

    monkeypatch.setattr(dispatch, "stamp_ready", stamp_then_wait)
    errors: list[BaseException] = []

    def one_fill() -> None:
        cluster = Cluster(celery_app, settings)
        try:
            fill(cluster, Window(cluster))
        except BaseException as exc:
            errors.append(exc)
        finally:
            cluster.close()

    threads = [threading.Thread(target=one_fill) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(stamped) == 2

    chosen = [ref.task_id for refs in stamped for ref in refs]
    assert len(chosen) == len(set(chosen)) and 0 < len(chosen) <= 30
    assert messages(redis_client, queue_prefix)["exports"] == ids(sorted(chosen, key=str))
    assert {t for t in rows if task_row(engine, t)["dispatched_at"]} == set(chosen)


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_publish_refused_makes_the_runs_ready_again_and_the_next_scan_publishes(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    broker: str,
) -> None:
    offer()
    rows = waiting_rows(engine, world, 3)
    port = closed_port()
    url = f"redis://127.0.0.1:{port}/0" if broker == "redis" else f"amqp://127.0.0.1:{port}//"
    down = make_app(broker_url=url)
    down.conf.broker_connection_timeout = 1
    down.conf.broker_connection_max_retries = 1

    counts = run_once(down, uptime=long_up)

    assert (counts.dispatched, counts.publish_failed) == (0, 3)
    assert counts.redis_error is not None
    for task_id in rows:
        row = task_row(engine, task_id)
        assert (row["status"], row["dispatched_at"]) == ("WAITING", None)
    assert markers(redis_client, queue_prefix) == set()
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}

    up = make_app(broker_url=settings.redis_url)
    retry = run_once(up, uptime=long_up)

    assert (retry.dispatched, retry.publish_failed, retry.redis_error) == (3, 0, None)
    assert messages(redis_client, queue_prefix) == {"exports": ids(rows), "reminders": []}


def test_an_old_failure_of_the_same_message_does_not_keep_the_run_from_running(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    """An earlier message of this run ended FAILURE (say its claim could not reach the
    database); the run was recovered since. The queue's record says nothing about the
    run now: only the ledger decides, and the run is published."""
    offer()
    task_id = waiting_rows(engine, world, 1)[0]
    celery_app.backend.mark_as_failure(f"{task_id}-0", RuntimeError("claim failed earlier"))
    set_columns(engine, task_id, recoveries=1)

    counts = run_once(celery_app, uptime=long_up)

    assert counts.dispatched == 1
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"]) == ("WAITING", None)
    assert messages(redis_client, queue_prefix) == {"exports": [f"{task_id}-0"], "reminders": []}


# --- re-publish lost messages ----------------------------------------------------------------


def test_a_published_run_whose_marker_is_gone_or_stale_is_published_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offer()
    backlog, lost, stale_marker = waiting_rows(engine, world, 3)
    assert run_once(celery_app, uptime=long_up).dispatched == 3
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    # The broker lost two messages (say Redis restarted without persistence): the marker
    # of ``lost`` went with them; ``stale_marker`` carries the marker of an earlier
    # publish. ``backlog`` waits behind a slow queue, its marker intact.
    redis_client.delete(f"{queue_prefix}:exports")
    redis_client.delete(f"{queue_prefix}:queued:{lost}-0")
    redis_client.set(f"{queue_prefix}:queued:{stale_marker}-0", "2026-01-01T00:00:00+00:00")
    before = {t: task_row(engine, t)["dispatched_at"] for t in (backlog, lost, stale_marker)}

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.redispatched, counts.dispatched) == (2, 0)
    assert messages(redis_client, queue_prefix) == {
        "exports": ids(sorted([lost, stale_marker], key=str)),
        "reminders": [],
    }
    for task_id in (lost, stale_marker):
        assert task_row(engine, task_id)["dispatched_at"] > before[task_id]
        marker = redis_client.get(f"{queue_prefix}:queued:{task_id}-0")
        assert marker == stamp_of(engine, task_id)
    assert task_row(engine, backlog)["dispatched_at"] == before[backlog]  # not published again
    assert run_once(celery_app, uptime=long_up).redispatched == 0


def test_a_run_published_moments_ago_is_not_judged_lost(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    """Its publish may still be under way (another dispatcher's, in an overlap)."""
    offer()
    recent = waiting_rows(engine, world, 1)[0]
    assert run_once(celery_app, uptime=long_up).dispatched == 1
    redis_client.delete(f"{queue_prefix}:queued:{recent}-0")
    stamped = task_row(engine, recent)["dispatched_at"]

    assert run_once(celery_app, uptime=long_up).redispatched == 0
    assert task_row(engine, recent)["dispatched_at"] == stamped
    shift(engine, recent, "dispatched_at", scan_module.PUBLISH_GRACE_S + 1)
    assert run_once(celery_app, uptime=long_up).redispatched == 1


def test_lost_messages_of_a_queue_nobody_consumes_wait_for_a_consumer(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_app(dispatch_window=2)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    task_id = waiting_rows(engine, world, 1, kind="REMINDER")[0]
    assert run_once(app, uptime=long_up).dispatched == 1
    redis_client.delete(f"{queue_prefix}:queued:{task_id}-0")

    assert run_once(app, uptime=long_up).redispatched == 0  # no consumer: it may be waiting
    offer(concurrency=1, queues=("reminders",))
    assert run_once(app, uptime=long_up).redispatched == 1


# --- recover -----------------------------------------------------------------------------------


def test_stale_running_run_goes_back_to_waiting_and_is_published_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    offer()
    stale = running_row(engine, world, holder=None, kind="REMINDER")
    busy = running_row(engine, world, holder=None)
    age_task(engine, stale, settings.stale_after_s + 5)
    busy_before = task_row(engine, busy)

    with caplog.at_level(logging.INFO):
        counts = run_once(celery_app, uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (1, 0, 1)
    row = task_row(engine, stale)
    assert (row["status"], row["recoveries"], row["execution_id"], row["lease_holder"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert row["attempts"] == 0  # stalls have their own budget
    assert row["dispatched_at"] is not None  # recovered, then dispatched by the same scan
    assert task_row(engine, busy) == busy_before
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": [f"{stale}-0"]}
    [record] = [r for r in caplog.records if getattr(r, "event", None) == "task.stalled"]
    assert (record.task_id, record.run, record.outcome) == (str(stale), 0, "WAITING")  # type: ignore[attr-defined]


def test_a_lease_written_just_now_is_not_stale(
    engine: sa.Engine, world: World, celery_app: Celery, settings: Settings
) -> None:
    """Staleness is measured by the database's clock on updated_at: a lease one second
    short of STALE_AFTER_S stays."""
    task_id = running_row(engine, world, holder=None)
    age_task(engine, task_id, settings.stale_after_s - 1)
    before = task_row(engine, task_id)

    assert run_once(celery_app, uptime=long_up).recovered == 0
    assert task_row(engine, task_id) == before


def test_run_past_max_recoveries_fails_with_the_fixed_message(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
) -> None:
    offer()
    task_id = running_row(engine, world, recoveries=settings.max_recoveries)
    age_task(engine, task_id, settings.stale_after_s + 5)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.recovered, counts.failed_recoveries, counts.dispatched) == (0, 1, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["last_error"], row["recoveries"]) == (
        "FAILED",
        "The task stopped responding too many times.",
        settings.max_recoveries,
    )
    assert (row["execution_id"], row["lease_holder"], row["dispatched_at"]) == (None, None, None)
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


def test_dead_holder_is_recovered_before_the_stale_rule_when_heartbeats_are_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
) -> None:
    live_worker = offer()
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    alive = running_row(engine, world, holder=live_worker.member)
    unregistered = running_row(engine, world, holder=None)  # only the 2-minute rule applies
    alive_before, unregistered_before = task_row(engine, alive), task_row(engine, unregistered)

    counts = run_once(celery_app, uptime=long_up)

    assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (True, 1, 1)
    row = task_row(engine, dead)
    assert (row["status"], row["recoveries"], row["lease_holder"], row["execution_id"]) == (
        "WAITING",
        1,
        None,
        None,
    )
    assert task_row(engine, alive) == alive_before
    assert task_row(engine, unregistered) == unregistered_before
    assert messages(redis_client, queue_prefix) == {"exports": [f"{dead}-0"], "reminders": []}


@pytest.mark.parametrize("why", ["redis restarted less than one TTL ago", "heartbeat read failed"])
def test_dead_holder_is_not_recovered_early_when_heartbeats_cannot_be_trusted(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    settings: Settings,
    offer: Callable[..., Heartbeat],
    why: str,
) -> None:
    offer()
    dead = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    stale = running_row(engine, world, holder=f"test-host/{uuid.uuid4()}")
    age_task(engine, stale, settings.stale_after_s + 5)
    dead_before = task_row(engine, dead)
    if why == "heartbeat read failed":

        def unreadable(_client: redis.Redis) -> float:
            raise redis.ConnectionError("Redis went away")

        counts = run_once(celery_app, uptime=unreadable)
        assert counts.redis_error == "ConnectionError"
    else:
        just_started = settings.heartbeat_ttl_s - 1
        counts = run_once(celery_app, uptime=lambda _c: just_started)
        assert counts.redis_error is None

    assert (counts.heartbeat_rule, counts.recovered, counts.dispatched) == (False, 1, 1)
    assert task_row(engine, dead) == dead_before  # cannot tell is never dead
    assert task_row(engine, stale)["status"] == "WAITING"  # the 2-minute rule still holds
    assert messages(redis_client, queue_prefix) == {"exports": [f"{stale}-0"], "reminders": []}


def test_holder_that_registered_and_claimed_after_the_heartbeat_read_is_not_taken_for_dead(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    """A process starts between the scan's heartbeat read and its recovery statement:
    it registers and claims; its member is missing from what the scan read."""
    task_id = waiting_rows(engine, world, 1)[0]
    newcomer = Heartbeat(redis_client, queue_prefix, "test-host", 20.0)
    claimed: list[lease.Claim | None] = []

    def uptime_then_newcomer_claims(client: redis.Redis) -> float:
        # Runs inside the scan, after it read the live members (the gate point).
        assert newcomer.renew()
        with engine.begin() as conn:
            claimed.append(lease.claim(conn, task_id, 0, newcomer.member))
        return LONG_UP

    try:
        counts = run_once(celery_app, uptime=uptime_then_newcomer_claims)
    finally:
        newcomer.remove()

    assert claimed and claimed[0] is not None
    assert (counts.heartbeat_rule, counts.recovered) == (True, 0)
    row = task_row(engine, task_id)
    assert (row["status"], row["lease_holder"], row["recoveries"]) == (
        "RUNNING",
        newcomer.member,
        0,
    )
    assert row["execution_id"] == claimed[0].lease.execution_id
    assert messages(redis_client, queue_prefix) == {"exports": [], "reminders": []}


# --- purge -------------------------------------------------------------------------------------


def test_purge_clears_only_expired_csvs_by_the_database_clock(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    expired, kept = running_row(engine, world), running_row(engine, world)
    for row_id, expires in ((expired, "- interval '1 minute'"), (kept, "+ interval '1 hour'")):
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"""UPDATE background_tasks
                   SET status = 'COMPLETED', execution_id = NULL, lease_holder = NULL,
                       result_csv = 'id,title' || chr(10), result_summary = '1 rows',
                       expires_at = now() {expires}
                 WHERE id = :id"""),
                {"id": row_id},
            )
    kept_before = task_row(engine, kept)

    counts = run_once(celery_app, uptime=long_up)

    assert counts == ScanCounts(purged=1, heartbeat_rule=True)
    row = task_row(engine, expired)
    assert (row["status"], row["result_csv"], row["result_summary"]) == (
        "COMPLETED",
        None,
        "1 rows",
    )
    assert task_row(engine, kept) == kept_before


def test_time_passed_in_from_a_host_is_nowhere_in_the_dispatcher_statements() -> None:
    """Every threshold is the database's clock: no statement takes a time parameter other
    than stamps read back from the ledger itself."""
    statements = {
        name: getattr(dispatch, name).text
        for name in dir(dispatch)
        if name.isupper() and hasattr(getattr(dispatch, name), "text")
    }
    params = {name: set(getattr(dispatch, name).compile().params) for name in statements}
    allowed_times = {"holders_seen_at", "stamp", "stamps"}  # all read from the database
    for name, names in params.items():
        suspicious = {p for p in names if p.endswith(("_at", "now", "before"))}
        assert suspicious <= allowed_times, (name, suspicious)
