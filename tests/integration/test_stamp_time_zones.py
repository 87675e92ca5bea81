"""A publish's stamp is one instant, whatever the ``TimeZone`` of the database session
that reads it (tasks/queueing.py, ``stamp_text``; docs/design.md, "Dispatch", step 2).

The dispatcher reads ``dispatched_at`` back as a timestamp in its session's time zone.
A stamp rendered with its UTC offset and compared as text would make a dispatcher whose
session has another ``TimeZone`` (a new leader, a database or role default changed,
another server behind a pooler) take every message of the window for another publish's,
and publish every run again, once."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher import scan as scan_module
from harness.factories import World, task_row
from teamdesk.heartbeat import Heartbeat
from tests.support.dispatch_scan import dispatcher, ids, messages, waiting_rows

KOLKATA = "Asia/Kolkata"  # UTC+05:30


def set_time_zone(engine: sa.Engine, zone: str) -> None:
    """The database's default ``TimeZone``: every new session starts with it."""
    with engine.connect() as conn:
        name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
        conn.execute(sa.text(f"ALTER DATABASE \"{name}\" SET TimeZone = '{zone}'"))
        conn.commit()


def stamps(engine: sa.Engine, task_ids: list[uuid.UUID]) -> dict[uuid.UUID, object]:
    return {t: task_row(engine, t)["dispatched_at"] for t in task_ids}


@pytest.mark.parametrize(
    ("publisher", "scanner"), [("UTC", KOLKATA), (KOLKATA, "UTC")], ids=["to-kolkata", "to-utc"]
)
def test_a_scan_under_another_time_zone_publishes_nothing_again(
    engine: sa.Engine,
    world: World,
    celery_app: Celery,
    redis_client: redis.Redis,
    queue_prefix: str,
    offer: Callable[..., Heartbeat],
    monkeypatch: pytest.MonkeyPatch,
    publisher: str,
    scanner: str,
) -> None:
    offer(concurrency=2, queues=("exports",))
    runs = waiting_rows(engine, world, 3)
    monkeypatch.setattr(scan_module, "PUBLISH_GRACE_S", 0.0)
    set_time_zone(engine, publisher)
    with dispatcher(celery_app) as next_scan:
        assert next_scan().dispatched == 3
    published = stamps(engine, runs)

    set_time_zone(engine, scanner)
    with dispatcher(celery_app) as next_scan:
        for _ in range(3):  # the broker is looked at twice before a message is judged lost
            counts = next_scan()
            assert (counts.redispatched, counts.missing_from_broker, counts.dispatched) == (
                0,
                0,
                0,
            )
    assert stamps(engine, runs) == published
    assert sorted(messages(redis_client, queue_prefix)["exports"]) == sorted(ids(runs))
