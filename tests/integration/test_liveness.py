"""One worker process's renewals (worker/liveness.py) against the real Redis and
PostgreSQL: the heartbeat and the visibility of its messages fail independently, and a
heartbeat that could not be renewed says so (docs/design.md, "Heartbeats")."""

from __future__ import annotations

import logging

import pytest
import redis

from teamdesk.config import Settings
from teamdesk.heartbeat import live_members
from tests.support.queues import closed_port
from worker.liveness import Liveness


def failures(caplog: pytest.LogCaptureFixture) -> list[str | None]:
    return [
        getattr(r, "stage", None)
        for r in caplog.records
        if getattr(r, "event", None) == "heartbeat.failed"
    ]


def test_a_broker_error_does_not_stop_the_heartbeat(
    settings: Settings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broken = settings.with_overrides(broker_url=f"redis://127.0.0.1:{closed_port()}/0")
    liveness = Liveness(broken, lambda: ["delivery-tag-1"])
    try:
        with caplog.at_level(logging.WARNING):
            liveness.tick()
            liveness.tick()

        assert live_members(redis_client, settings.queue_prefix) == {liveness.member}
        assert liveness.registered is True
        assert failures(caplog) == ["visibility"]  # once per outage, not once per tick
    finally:
        liveness.stop()
    assert live_members(redis_client, settings.queue_prefix) == set()


def test_a_database_that_refuses_new_connections_pauses_intake_not_the_heartbeat(
    settings: Settings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    refused = settings.with_overrides(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
    )
    liveness = Liveness(refused, lambda: [])
    try:
        with caplog.at_level(logging.WARNING):
            liveness.tick()
            liveness.tick()

        # Alive, and its leases with it: only new messages wait (worker/steps.py, Intake).
        assert live_members(redis_client, settings.queue_prefix) == {liveness.member}
        assert (liveness.registered, liveness.database_ok) == (True, False)
        assert liveness.may_take_work is False
        assert failures(caplog) == ["database"]
    finally:
        liveness.stop()
