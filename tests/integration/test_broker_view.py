"""The scan looks at the broker (tasks/broker_view.py, docs/design.md "Operating with
Celery's tools"): a published run whose message the broker held in neither of two looks
a scan apart is published again; a message waiting in the list or delivered and not yet
acknowledged is held; where the broker cannot list its messages, a run past LOST_AFTER
is published again. Real Redis, Celery's own purge, kombu's own consumer."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from kombu import Queue

from dispatcher import scan as scan_module
from harness.factories import World, task_row
from tasks import broker_view
from tasks.names import EXPORTS_QUEUE
from teamdesk.config import get_settings
from teamdesk.heartbeat import Heartbeat
from tests.support.dispatch_scan import dispatcher, ids, messages, other_team, waiting_rows


def stamps(engine: sa.Engine, task_ids: list[uuid.UUID]) -> dict[uuid.UUID, object]:
    return {t: task_row(engine, t)["dispatched_at"] for t in task_ids}


def test_a_purged_window_is_published_again_within_two_scans_and_runs_once(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``celery purge`` empties the list: the runs must not stay WAITING and published,
    filling the window."""
    offer(concurrency=2, queues=("exports",))
    runs = waiting_rows(engine, world, 3)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    with dispatcher(celery_app) as next_scan:
        assert next_scan().dispatched == 3
        first = stamps(engine, runs)
        assert celery_app.control.purge() == 3  # what `celery -A tasks purge -f` does
        assert messages(redis_client, queue_prefix)["exports"] == []

        look = next_scan()  # one look can miss a message in transit: nothing yet
        assert (look.redispatched, look.missing_from_broker, look.dispatched) == (0, 0, 0)
        assert stamps(engine, runs) == first
        again = next_scan()
        assert (again.redispatched, again.missing_from_broker) == (3, 3)
        assert again.of_note and "missing from the broker 3" in again.summary()

        assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(ids(runs))
        for task_id, stamp in stamps(engine, runs).items():
            assert stamp is not None and stamp > first[task_id]  # type: ignore[operator]
            assert task_row(engine, task_id)["status"] == "WAITING"
        settled = next_scan()  # the broker holds them again: nothing more
        assert (settled.redispatched, settled.missing_from_broker) == (0, 0)
        settled = next_scan()
        assert (settled.redispatched, settled.missing_from_broker) == (0, 0)


def test_a_purged_run_keeps_its_teams_slot_until_its_message_is_back(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TEAM_MAX_RUNNING=1. A run whose message was purged is owed, not gone: it keeps its
    team's slot (the team's next run is not published beside it, which would put two in
    flight once the purged one is back) and gets its message back within two looks; then
    it still holds the slot, as a run in the broker does. Another team is never held up."""
    offer(concurrency=10, queues=("exports",))
    team_b = other_team(engine, "B")
    first_a, second_a = waiting_rows(engine, world, 2)
    (only_b,) = waiting_rows(engine, team_b, 1)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    with dispatcher(celery_app, team_max_running=1) as next_scan:
        assert next_scan().dispatched == 2
        assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(
            ids([first_a, only_b])
        )
        assert celery_app.control.purge() == 2

        for _ in range(2):  # the first look may miss a message in transit; the second sends
            next_scan()
            assert task_row(engine, second_a)["dispatched_at"] is None  # A is at its cap
        assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(
            ids([first_a, only_b])
        )
        settled = next_scan()
        assert (settled.dispatched, settled.redispatched) == (0, 0)
    assert task_row(engine, second_a)["dispatched_at"] is None
    assert [task_row(engine, t)["status"] for t in (first_a, second_a, only_b)] == ["WAITING"] * 3


def test_a_delivered_unacknowledged_message_is_held_and_only_the_missing_one_returns(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message a worker took and has not acknowledged is in kombu's unacked hash (here
    taken by kombu's own consumer): held. The one removed from the list is not."""
    offer(concurrency=1, queues=("exports",))
    runs = waiting_rows(engine, world, 2)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    with dispatcher(celery_app) as next_scan, celery_app.connection_for_read() as conn:
        assert next_scan().dispatched == 2
        delivered = Queue(EXPORTS_QUEUE).bind(conn.default_channel).get(no_ack=False)
        assert delivered is not None
        taken = delivered.headers["id"]
        assert redis_client.hlen(f"{queue_prefix}:unacked") == 1
        assert messages(redis_client, queue_prefix)["exports"] != [taken]
        left = uuid.UUID(messages(redis_client, queue_prefix)["exports"][0][:36])
        before = stamps(engine, runs)
        for _ in range(3):
            counts = next_scan()
            assert (counts.redispatched, counts.missing_from_broker) == (0, 0)
        assert stamps(engine, runs) == before

        redis_client.delete(f"{queue_prefix}:{EXPORTS_QUEUE}")  # lost from the list only
        assert next_scan().redispatched == 0
        assert next_scan().redispatched == 1
        after = stamps(engine, runs)
        assert after[left] != before[left]
        held = next(t for t in runs if t != left)
        assert after[held] == before[held]
        assert messages(redis_client, queue_prefix)["exports"] == ids([left])
        delivered.ack()


def test_a_list_too_long_to_read_leaves_the_stamps_age_to_decide(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queue longer than LIST_LIMIT is not read: the scan cannot tell which message is
    missing. A run whose message is gone waits until its stamp is past LOST_AFTER (the
    database's clock), then it alone is published again; the others keep their stamps."""
    offer(concurrency=2, queues=("exports",))
    runs = waiting_rows(engine, world, 3)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    monkeypatch.setattr(broker_view, "LIST_LIMIT", 1)
    with dispatcher(celery_app) as next_scan:
        assert next_scan().dispatched == 3
        lost = runs[1]
        entry = raw_message(redis_client, queue_prefix, lost)
        assert redis_client.lrem(f"{queue_prefix}:{EXPORTS_QUEUE}", 1, entry) == 1
        before = stamps(engine, runs)
        for _ in range(2):
            counts = next_scan()
            assert (counts.redispatched, counts.missing_from_broker, counts.overdue) == (0, 0, 0)
        assert stamps(engine, runs) == before
        overdue_s = scan_module.LOST_AFTER_FACTOR * get_settings().stale_after_s
        with engine.begin() as conn:  # its stamp, as if published LOST_AFTER ago
            conn.execute(
                sa.text(
                    "UPDATE background_tasks SET dispatched_at = now() - make_interval("
                    "secs => :s) WHERE id = :id"
                ),
                {"s": overdue_s + 1, "id": lost},
            )
        counts = next_scan()
        assert (counts.redispatched, counts.missing_from_broker, counts.overdue) == (1, 0, 1)
        after = stamps(engine, runs)
    assert [after[t] == before[t] for t in runs] == [True, False, True]
    assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(ids(runs))


def raw_message(client: redis.Redis, prefix: str, task_id: uuid.UUID) -> str:
    """The raw list entry of ``task_id``'s run 0 message."""
    for raw in client.lrange(f"{prefix}:{EXPORTS_QUEUE}", 0, -1):
        if json.loads(raw)["headers"]["id"] == f"{task_id}-0":
            return str(raw)
    raise AssertionError(f"no message of {task_id}")


def test_a_message_taken_by_a_consumer_that_never_claims_it_is_published_again_after_lost_after(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker takes a message (it moves to kombu's unacked hash) and dies before its
    claim: the broker still holds the message, and gives it back only after its visibility
    timeout, an hour. The run is published again once its stamp is past LOST_AFTER (here
    made 0 s), not before; the run still waiting in the list is left alone."""
    offer(concurrency=1, queues=("exports",))
    runs = waiting_rows(engine, world, 2)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    with dispatcher(celery_app) as next_scan, celery_app.connection_for_read() as conn:
        assert next_scan().dispatched == 2
        taken = Queue(EXPORTS_QUEUE).bind(conn.default_channel).get(no_ack=False)
        assert taken is not None  # never acknowledged: its consumer is gone
        stuck = uuid.UUID(taken.headers["id"][:36])
        before = stamps(engine, runs)
        for _ in range(3):
            counts = next_scan()
            assert (counts.redispatched, counts.missing_from_broker, counts.overdue) == (0, 0, 0)
        assert stamps(engine, runs) == before
        monkeypatch.setattr(scan_module, "LOST_AFTER_MIN_S", 0.0)  # LOST_AFTER passes
        monkeypatch.setattr(scan_module, "LOST_AFTER_FACTOR", 0)
        counts = next_scan()
        assert (counts.redispatched, counts.missing_from_broker, counts.overdue) == (1, 0, 1)
        after = stamps(engine, runs)
        waiting = next(t for t in runs if t != stuck)
        assert after[waiting] == before[waiting]
        assert after[stuck] is not None and after[stuck] != before[stuck]
        assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(ids(runs))
        settled = next_scan()
        assert (settled.redispatched, settled.overdue) == (0, 0)
