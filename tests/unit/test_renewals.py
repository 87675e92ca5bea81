"""The worker's renewal thread (worker/life.py, ``Loop``): its ticks run on a thread of
their own, and a stop waits for the tick under way, so nothing of a stopped worker
(a heartbeat renewal) runs after it. The database check has a thread of its own, of the
same kind, so it never delays a renewal."""

from __future__ import annotations

import threading

import pytest

from harness.waiting import wait_for
from worker.life import CHECKS, RENEWALS, Loop

GATE_TIMEOUT_S = 10.0


def test_ticks_run_on_their_own_thread_until_stopped() -> None:
    seen: list[str] = []
    two = threading.Event()

    def tick() -> None:
        seen.append(threading.current_thread().name)
        if len(seen) == 2:
            two.set()

    renewals = Loop(tick, 0.01)
    renewals.start()
    try:
        assert two.wait(GATE_TIMEOUT_S)
    finally:
        renewals.stop(GATE_TIMEOUT_S)
    assert not renewals._thread.is_alive()  # none can come after the stop returned
    assert set(seen) == {"teamdesk-liveness"}
    assert threading.current_thread().name not in seen
    renewals.stop(GATE_TIMEOUT_S)  # a second stop is harmless


def test_a_stop_waits_for_the_tick_under_way() -> None:
    order: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def tick() -> None:
        entered.set()
        release.wait(GATE_TIMEOUT_S)
        order.append("tick ended")

    renewals = Loop(tick, 0.01)
    renewals.start()

    def stop() -> None:
        renewals.stop(GATE_TIMEOUT_S)
        order.append("stop returned")

    stopper = threading.Thread(target=stop)
    try:
        assert entered.wait(GATE_TIMEOUT_S)
        stopper.start()
        wait_for(renewals._stopped.is_set, what="the stop to begin")
    finally:
        release.set()
    stopper.join(GATE_TIMEOUT_S)
    assert order == ["tick ended", "stop returned"]


def test_a_tick_that_raises_does_not_end_the_renewals(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    again = threading.Event()

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        again.set()

    renewals = Loop(tick, 0.01)
    renewals.start()
    try:
        assert again.wait(GATE_TIMEOUT_S)
    finally:
        renewals.stop(GATE_TIMEOUT_S)
    assert len(calls) >= 2
    failed = [r for r in caplog.records if r.getMessage() == "heartbeat.failed"]
    assert [(r.levelname, r.stage, r.error) for r in failed] == [  # type: ignore[attr-defined]
        ("ERROR", "tick", "RuntimeError")
    ]


def test_the_database_checks_start_at_once_on_a_thread_of_their_own() -> None:
    """The life's second ``Loop``: the database check, first right away (the worker's
    start waits for it), on its own thread, so a check that hangs holds no renewal."""
    seen: list[str] = []
    first = threading.Event()

    def check() -> None:
        seen.append(threading.current_thread().name)
        first.set()

    checks = Loop(check, 3600.0, CHECKS, at_once=True)  # the next one an hour on
    checks.start()
    try:
        assert first.wait(GATE_TIMEOUT_S)
    finally:
        checks.stop(GATE_TIMEOUT_S)
    assert not checks._thread.is_alive()
    assert seen == [CHECKS] and CHECKS != RENEWALS
