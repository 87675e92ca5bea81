"""Queued markers against real Redis (tasks/queueing.py). A message that has been claimed,
or whose claim failed, turns its marker into the ended record ``ended <stamp> ...``; a
marker the dispatcher sets later for an ended message is not set, in whatever order the
messages of the run's publishes end; a marker of another publish stays."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import redis

from ledger.dispatch import RunRef
from tasks import queueing
from teamdesk.config import Settings

STAMP_A = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
STAMP_B = STAMP_A + timedelta(seconds=7)
A, B = STAMP_A.isoformat(), STAMP_B.isoformat()


def publish_of(task_id: uuid.UUID, stamp: datetime) -> RunRef:
    return RunRef(task_id, 0, "EXPORT", stamp=stamp)


def test_a_marker_set_after_its_message_ended_does_not_stand_for_it(
    settings: Settings, redis_client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    first, second = publish_of(task_id, STAMP_A), publish_of(task_id, STAMP_B)

    queueing.message_started(task_id, 0, A)  # quicker than the marker
    queueing.set_markers([first], settings)
    assert redis_client.get(key) == f"ended {A}"
    assert queueing.marker_matches([first], settings) == [False]  # published again

    # The publish again, with its own stamp, and again the message is quicker.
    queueing.message_started(task_id, 0, B)
    queueing.set_markers([second], settings)
    assert redis_client.get(key) == f"ended {A} {B}"
    assert queueing.marker_matches([second], settings) == [False]
    assert 0 < redis_client.ttl(key) <= queueing.ENDED_TTL_S


def test_a_late_message_of_an_earlier_publish_keeps_the_later_ones_ended(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """B's message ends before B's marker is set, then A's (an earlier publish's duplicate)
    ends too: B's late marker is still not set."""
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    second = publish_of(task_id, STAMP_B)

    queueing.message_started(task_id, 0, B)
    queueing.message_started(task_id, 0, A)
    queueing.set_markers([second], settings)
    assert redis_client.get(key) == f"ended {B} {A}"
    assert queueing.marker_matches([second], settings) == [False]


def test_a_marker_set_again_after_its_message_was_claimed_is_not_set(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """The dispatcher's marker pipeline retried after a lost reply sets the marker a
    second time, after the message was claimed: the ended record stays."""
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    current = publish_of(task_id, STAMP_A)

    queueing.set_markers([current], settings)
    assert queueing.marker_matches([current], settings) == [True]
    queueing.message_started(task_id, 0, A)
    queueing.set_markers([current], settings)  # the replay
    assert redis_client.get(key) == f"ended {A}"
    assert queueing.marker_matches([current], settings) == [False]


def test_a_message_of_another_publish_leaves_the_current_marker_standing(
    settings: Settings, redis_client: redis.Redis
) -> None:
    task_id = uuid.uuid4()
    key = queueing.marker_key(task_id, 0)
    current = publish_of(task_id, STAMP_B)

    queueing.set_markers([current], settings)
    queueing.message_started(task_id, 0, A)  # an earlier publish's message
    assert redis_client.get(key) == B  # the current message still stands
    assert queueing.marker_matches([current], settings) == [True]
    assert 0 < redis_client.ttl(key) <= queueing.marker_ttl_s(settings)
    queueing.message_started(task_id, 0, B)
    assert redis_client.get(key) == f"ended {B}"
