"""The fork guard (worker/liveness.py, ``ForkGuard``) is re-entrant on one thread. The
worker's SIGTERM handler runs on the main thread (Celery's ``worker_shutting_down``,
worker/lifecycle.py) and logs under the guard; it may interrupt that thread while it holds
the guard itself (``Intake.follow(at_once=True)``, the fork's ``before`` hook). With a
plain lock the handler then waited for its own thread for ever: the worker hung on SIGTERM.

A deadlock here cannot end by itself, so each test arms a SIGALRM (GATE_TIMEOUT_S) whose
handler raises: a lock acquisition in Python is interrupted by signals, so the test fails
instead of hanging. It detects a wait that never ends; it orders nothing."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

from worker.forking import ForkGuard, fork_guard

GATE_TIMEOUT_S = 5.0


class GuardDeadlock(Exception):
    """The guard was waited for by the very thread holding it."""


def _give_up(signum: int, frame: FrameType | None) -> None:
    raise GuardDeadlock(f"still waiting for the fork guard after {GATE_TIMEOUT_S} s")


@contextmanager
def deadlock_alarm() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _give_up)
    signal.setitimer(signal.ITIMER_REAL, GATE_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def on_sigusr1() -> Iterator[list[str]]:
    """A SIGUSR1 handler that logs under the guard, as the worker's SIGTERM handler does."""
    entered: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        with fork_guard:
            entered.append(threading.current_thread().name)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield entered
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_handler_enters_the_guard_its_own_thread_holds(on_sigusr1: list[str]) -> None:
    with deadlock_alarm(), fork_guard:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs now, on this thread
        assert on_sigusr1 == [threading.current_thread().name]
    assert on_sigusr1 == [threading.main_thread().name]


def test_the_guard_still_keeps_other_threads_out() -> None:
    guard = ForkGuard()
    tried: list[bool] = []

    def try_enter() -> None:
        got = guard._lock.acquire(blocking=False)
        tried.append(got)
        if got:
            guard._lock.release()

    with guard:
        other = threading.Thread(target=try_enter)
        other.start()
        other.join(GATE_TIMEOUT_S)
    other = threading.Thread(target=try_enter)
    other.start()
    other.join(GATE_TIMEOUT_S)
    assert tried == [False, True]  # held by this thread: not by another meanwhile


def test_a_fork_by_the_thread_holding_the_guard_gives_the_child_a_free_one() -> None:
    """The fork's ``before`` hook takes the guard on the forking thread: with that thread
    holding it already (a handler that forks, a fork under the guard) it must not wait for
    itself, and the child starts with a guard nobody holds."""
    with deadlock_alarm(), fork_guard:
        pid = os.fork()
        if pid == 0:  # the child: only this thread, and a guard of its own
            code = 1
            try:
                with fork_guard:
                    code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with deadlock_alarm(), fork_guard:  # released in the parent after the fork
        pass
