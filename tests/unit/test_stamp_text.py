"""A publish's stamp as messages carry it (tasks/queueing.py): in UTC whatever
the UTC offset it was read with, and compared as a timestamp when read back."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone

from ledger.dispatch import RunRef
from tasks import broker_view, queueing

KOLKATA = timezone(timedelta(hours=5, minutes=30))
INSTANT = datetime(2026, 12, 2, 9, 0, 0, 123456, tzinfo=UTC)
UTC_TEXT = "2026-12-02T09:00:00.123456+00:00"


def test_a_stamp_read_in_another_time_zone_has_the_same_text() -> None:
    run = RunRef(uuid.uuid4(), 0, "EXPORT", stamp=INSTANT.astimezone(KOLKATA))
    assert queueing.stamp_text(run) == UTC_TEXT
    assert queueing.stamp_text(RunRef(run.task_id, 0, "EXPORT", stamp=INSTANT)) == UTC_TEXT


def test_a_stamp_written_with_another_offset_reads_back_as_the_same_publish() -> None:
    assert queueing.canonical_stamp(INSTANT.astimezone(KOLKATA).isoformat()) == UTC_TEXT
    assert queueing.canonical_stamp(UTC_TEXT) == UTC_TEXT
    for other in (f"ended {UTC_TEXT}", "", "2026-12-02T09:00:00", "not a stamp"):
        assert queueing.canonical_stamp(other) == other


def test_the_broker_view_knows_a_message_by_its_stamp_as_a_timestamp() -> None:
    args = [str(uuid.uuid4()), 0, INSTANT.astimezone(KOLKATA).isoformat()]
    body = json.dumps([args, {}, {}])
    message = {"headers": {"id": "m-0"}, "body": body, "properties": {}}
    assert broker_view._identity(message) == ("m-0", UTC_TEXT)
