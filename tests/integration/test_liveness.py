"""One worker process's renewals (worker/liveness.py) against the real Redis and
PostgreSQL: a heartbeat that could not be renewed says so, and the database check runs
where it cannot delay a renewal: a check that never returns pauses intake once its bound
has passed, and the heartbeat goes on (docs/design.md, "Heartbeats"; issue 34)."""

from __future__ import annotations

import logging
import threading

import pytest
import redis
from celery import Celery

from teamdesk.config import Settings
from teamdesk.heartbeat import lease_holders_alive, live_members
from tests.support.queues import closed_port
from tests.support.workers import running_worker
from worker import life
from worker.liveness import Liveness, renew_interval_s

GATE_TIMEOUT_S = 10.0


def failures(caplog: pytest.LogCaptureFixture) -> list[str | None]:
    return [
        getattr(r, "stage", None)
        for r in caplog.records
        if getattr(r, "event", None) == "heartbeat.failed"
    ]


def failure_errors(caplog: pytest.LogCaptureFixture) -> list[tuple[str | None, str | None]]:
    return [
        (getattr(r, "stage", None), getattr(r, "error", None))
        for r in caplog.records
        if getattr(r, "event", None) == "heartbeat.failed"
    ]


class HungCheck:
    """A database check whose first ``answered`` calls answer at once and every later one
    hangs (DNS, a pooler's queue) until :attr:`release` is set."""

    def __init__(self, answered: int = 0) -> None:
        self.answered = answered
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls > self.answered:
            self.entered.set()
            assert self.release.wait(GATE_TIMEOUT_S), "the hung check was never released"
        return True


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_database_that_refuses_new_connections_pauses_intake_not_the_heartbeat(
    settings: Settings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    refused = settings.with_overrides(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere"
    )
    liveness = Liveness(refused)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                liveness.check_database()  # on the check's own thread in a worker
                liveness.tick()

        # Alive, and its leases with it: only new messages wait (worker/life.py, Intake).
        assert live_members(redis_client, settings.queue_prefix) == {liveness.member}
        assert (liveness.registered, liveness.database_ok) == (True, False)
        assert liveness.may_take_work is False
        assert failures(caplog) == ["database"]
    finally:
        liveness.stop()


def test_a_renewal_never_waits_on_the_database_check(
    settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the tick ran the check itself after the renewal: one that hung in a
    pooler's queue held the next renewal until the member had expired."""
    liveness = Liveness(settings.with_overrides(heartbeat_ttl_s=2.0))
    hung = HungCheck()
    monkeypatch.setattr(liveness, "_check_database", hung)
    try:
        for _ in range(2):  # the second renewal would come after a hung check
            ticker = threading.Thread(target=liveness.tick, name="test-renewal")
            ticker.start()
            ticker.join(GATE_TIMEOUT_S)
            assert not ticker.is_alive(), "the renewal waited on the database check"
        assert hung.calls == 0  # a renewal tick checks nothing but Redis
        assert liveness.registered is True
        assert liveness.member in live_members(redis_client, settings.queue_prefix)
    finally:
        hung.release.set()
        liveness.stop()


def test_a_check_that_never_returns_pauses_intake_once_its_bound_has_passed(
    settings: Settings, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The clock is the test's: the check's bound is two renewal intervals and
    PING_TIMEOUT_S, and the test moves time across it while the check hangs on a thread
    of its own and the renewals go on."""
    s = settings.with_overrides(heartbeat_ttl_s=2.0)
    liveness = Liveness(s)
    clock = FakeClock()
    liveness.clock = clock
    hung = HungCheck(answered=1)
    liveness._check_database = hung  # type: ignore[method-assign]
    interval = renew_interval_s(s)
    checker = threading.Thread(target=liveness.check_database, name="test-check")
    try:
        with caplog.at_level(logging.WARNING):
            liveness.check_database()  # answers
            liveness.tick()
            assert liveness.may_take_work is True

            clock.now += interval  # the next check starts, and hangs
            checker.start()
            assert hung.entered.wait(GATE_TIMEOUT_S)
            clock.now += liveness.check_overdue_s - 0.01
            liveness.tick()  # returns: it never waits for the check
            assert liveness.may_take_work is True  # within the bound: a slow check
            assert failures(caplog) == []

            clock.now += 0.02  # past the bound: the hung check counts as failed
            for _ in range(2):
                liveness.tick()
                assert liveness.registered is True
                assert liveness.database_ok is False
                assert liveness.may_take_work is False
            assert failure_errors(caplog) == [("database", "CheckOverdue")]  # once
            assert liveness.member in live_members(redis_client, s.queue_prefix)
            assert liveness.member in lease_holders_alive(redis_client, s.queue_prefix)

            hung.release.set()  # the pool freed: the check answers at last
            checker.join(GATE_TIMEOUT_S)
            assert liveness.checked.is_set()
            assert liveness.may_take_work is True

            def refused() -> bool:
                raise ConnectionRefusedError

            liveness._check_database = refused  # type: ignore[method-assign]
            liveness.check_database()  # a new outage: logged again
            assert liveness.may_take_work is False
        assert failure_errors(caplog) == [
            ("database", "CheckOverdue"),
            ("database", "ConnectionRefusedError"),
        ]
    finally:
        hung.release.set()
        checker.join(GATE_TIMEOUT_S)
        liveness.stop()


def checking_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == life.CHECKS and t.is_alive()]


def test_the_database_check_has_its_own_thread_that_ends_with_the_worker(
    celery_app: Celery, settings: Settings
) -> None:
    """Started with the liveness step, its first check done before the consumer starts,
    and ended on Celery's ``terminate`` path (every ``celery.contrib.testing`` worker's
    end): nothing checks a database the test is about to drop."""
    assert checking_threads() == [], "a check thread left over from an earlier test"
    with running_worker(celery_app):
        liveness = life.current_liveness()
        assert liveness is not None
        assert liveness.checked.is_set() and liveness.may_take_work
        assert len(checking_threads()) == 1
    assert checking_threads() == []


def test_a_check_that_ends_after_the_stop_changes_and_logs_nothing(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The step does not wait for a hung check to remove the member, nor for longer than
    a check's own bounds; when one ends later (the test's database dropped meanwhile),
    it logs nothing into later output and leaves the gate closed."""
    liveness = Liveness(settings)
    hung = HungCheck()
    liveness._check_database = hung  # type: ignore[method-assign]
    checker = threading.Thread(target=liveness.check_database, name="test-check")
    checker.start()
    assert hung.entered.wait(GATE_TIMEOUT_S)
    liveness.stop()

    def refused() -> bool:
        raise ConnectionRefusedError

    with caplog.at_level(logging.WARNING):
        hung.release.set()
        checker.join(GATE_TIMEOUT_S)
        liveness._check_database = refused  # type: ignore[method-assign]
        liveness.check_database()  # none starts once stopped
    assert failures(caplog) == []
    assert liveness.database_ok is False and not liveness.checked.is_set()
