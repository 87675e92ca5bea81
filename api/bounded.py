"""Health checks in daemon threads, each answer bounded by a deadline (docs/design.md, "HTTP API").

A frozen server can hold a socket read past any client-side timeout, so the caller stops
waiting at the deadline and the daemon thread is left to finish on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

MAX_CHECKS_IN_FLIGHT = 4
CHECK_THREAD_NAME = "teamdesk-health-check"

T = TypeVar("T")


class CheckFailed(Exception):
    """The check did not complete: an error, the deadline, or too many checks in flight."""


class BoundedChecks:
    """Starts checks in daemon threads, at most ``max_in_flight`` at once (counted for tests)."""

    def __init__(self, max_in_flight: int = MAX_CHECKS_IN_FLIGHT) -> None:
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._counts = threading.Lock()
        self.started = 0
        self.in_flight = 0
        self.most_in_flight = 0

    def start(self, check: Callable[[], T]) -> Future[T]:
        """``check()`` running in a new daemon thread; CheckFailed at once when no slot is free."""
        if not self._slots.acquire(blocking=False):
            raise CheckFailed("too many checks in flight")
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()  # a caller giving up cannot cancel it for others
        thread = threading.Thread(
            target=self._run, args=(check, future), name=CHECK_THREAD_NAME, daemon=True
        )
        self._count(+1)
        try:
            thread.start()
        except RuntimeError as exc:  # the process is out of threads
            self._count(-1)
            self._slots.release()
            raise CheckFailed("no thread for the check") from exc
        return future

    async def run(self, check: Callable[[], T], deadline_s: float) -> T:
        """``check()``'s result, or CheckFailed (its cause set) when it raised or overran."""
        return await wait_for_check(self.start(check), deadline_s)

    def _run(self, check: Callable[[], T], future: Future[T]) -> None:
        try:
            outcome: tuple[str, Any] = ("result", check())
        except Exception as exc:
            outcome = ("error", exc)
        finally:
            # Free the slot before anyone hears the answer: whoever reacts to it may
            # start the next check at once.
            self._count(-1)
            self._slots.release()
        kind, value = outcome
        if kind == "result":
            future.set_result(value)
        else:
            future.set_exception(value)

    def _count(self, change: int) -> None:
        with self._counts:
            self.in_flight += change
            if change > 0:
                self.started += change
                self.most_in_flight = max(self.most_in_flight, self.in_flight)


async def wait_for_check(future: Future[T], deadline_s: float) -> T:
    """``future``'s result within ``deadline_s``, else CheckFailed (its cause set).

    Giving up leaves the check running: other callers may still be waiting for it.
    """
    try:
        return await asyncio.wait_for(_on_this_loop(future), deadline_s)
    except Exception as exc:
        raise CheckFailed(type(exc).__name__) from exc


def _on_this_loop(source: Future[T]) -> asyncio.Future[T]:
    """An asyncio future on the running loop that settles when ``source`` does."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def report(done: Future[T]) -> None:
        # RuntimeError: the loop closed while the check ran, so nobody is waiting.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, waiter, done)

    source.add_done_callback(report)
    return waiter


def _settle(waiter: asyncio.Future[T], source: Future[T]) -> None:
    if waiter.done():  # the caller stopped waiting at its deadline
        return
    error = source.exception()
    if error is None:
        waiter.set_result(source.result())
    else:
        waiter.set_exception(error)


@dataclass(frozen=True)
class _Flight(Generic[T]):
    started_at: float  # by the SharedCheck's clock
    future: Future[T]


class SharedCheck(Generic[T]):
    """One check that concurrent callers share (single-flight), and its last pass while fresh.

    A flight older than the caller's deadline is presumed hung and a new one started. A
    pass's age counts from its check's *start*; failures are never reused. Every caller of
    one SharedCheck passes the same check; only the one that starts a check runs it.
    """

    def __init__(
        self,
        runner: BoundedChecks | None = None,
        *,
        fresh_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner if runner is not None else BoundedChecks()
        self._fresh_s = fresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flight: _Flight[T] | None = None
        self._passed: _Flight[T] | None = None

    async def run(self, check: Callable[[], T], deadline_s: float) -> T:
        """A fresh pass, else the result of the check in flight (joined or started here),
        within ``deadline_s``; CheckFailed (its cause set) otherwise."""
        return await wait_for_check(self._fresh_or_in_flight(check, deadline_s).future, deadline_s)

    def _fresh_or_in_flight(self, check: Callable[[], T], deadline_s: float) -> _Flight[T]:
        with self._lock:
            now = self._clock()
            passed, flight = self._passed, self._flight
            if passed is not None and now - passed.started_at < self._fresh_s:
                return passed
            if flight is not None and _joinable(flight, now, deadline_s):
                return flight
            flight = self._flight = _Flight(now, self.runner.start(check))
        # Outside the lock: a check already done runs the callback here, and it locks.
        flight.future.add_done_callback(functools.partial(self._remember, flight))
        return flight

    def _remember(self, flight: _Flight[T], done: Future[T]) -> None:
        if done.exception() is not None:
            return
        with self._lock:
            if self._passed is None or flight.started_at > self._passed.started_at:
                self._passed = flight


def _joinable(flight: _Flight[Any], now: float, deadline_s: float) -> bool:
    """Still running, and young enough that its callers may not have given up yet."""
    return not flight.future.done() and now - flight.started_at < deadline_s
