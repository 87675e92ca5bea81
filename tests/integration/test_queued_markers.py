"""Queued markers against real Redis (tasks/queueing.py): a message that ends before the
dispatcher has set its marker leaves it ``ended <stamp>``, and the late marker does not
stand for it - also when the run's earlier publish left an ended marker of its own."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import redis

from ledger.dispatch import RunRef
from tasks import queueing
from teamdesk.config import Settings

STAMP_A = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
STAMP_B = STAMP_A + timedelta(seconds=7)


def publish_of(task_id: uuid.UUID, stamp: datetime) -> RunRef:
    return RunRef(task_id, 0, "EXPORT", stamp=stamp)


def test_a_marker_set_after_its_message_ended_does_not_stand_for_it(
    settings: Settings, redis_client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    first, second = publish_of(task_id, STAMP_A), publish_of(task_id, STAMP_B)

    queueing.message_started(task_id, 0, STAMP_A.isoformat())  # quicker than the marker
    queueing.set_markers([first], settings)
    assert redis_client.get(key) == f"ended {STAMP_A.isoformat()}"
    assert queueing.marker_matches([first], settings) == [False]  # published again

    # The publish again, with its own stamp, and again the message is quicker.
    queueing.message_started(task_id, 0, STAMP_B.isoformat())
    queueing.set_markers([second], settings)
    assert redis_client.get(key) == f"ended {STAMP_B.isoformat()}"
    assert queueing.marker_matches([second], settings) == [False]
    assert 0 < redis_client.ttl(key) <= queueing.marker_ttl_s(settings)


def test_a_marker_set_first_is_deleted_by_its_own_message_only(
    settings: Settings, redis_client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    current = publish_of(task_id, STAMP_B)

    queueing.set_markers([current], settings)
    assert queueing.marker_matches([current], settings) == [True]
    queueing.message_started(task_id, 0, STAMP_A.isoformat())  # an earlier publish's message
    assert redis_client.get(key) == STAMP_B.isoformat()  # the current message still stands
    queueing.message_started(task_id, 0, STAMP_B.isoformat())
    assert redis_client.get(key) is None
