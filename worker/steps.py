"""The worker bootstep that keeps a worker process's liveness in Redis (worker/liveness.py),
checks its database on a thread of its own, and takes messages only while both hold
(docs/design.md, "Heartbeats")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from teamdesk.config import get_settings
from teamdesk.heartbeat import WorkerSlots
from teamdesk.logs import log_event
from worker.liveness import (
    CHECK_S,
    RENEW_TIMEOUT_S,
    Liveness,
    fork_guard,
    held_delivery_tags,
    renew_interval_s,
)

log = logging.getLogger("teamdesk.worker")

_current: Liveness | None = None
_holder: str | None = None

WAKE_S = 0.1
# How long a stop waits for a renewal under way: two Redis calls.
STOP_WAIT_S = 2 * RENEW_TIMEOUT_S + 1.0
# How long a stop waits for a database check under way, and the start for the first one:
# a check within libpq's bounds. A hung one is not waited for longer (see LivenessStep).
CHECK_WAIT_S = CHECK_S + 1.0


def _noop() -> None:
    """Nothing: the timer exists to bound the event loop's sleep (see LivenessStep.start)."""


def current_liveness() -> Liveness | None:
    """This process's liveness, once the worker built it (None outside a worker)."""
    return _current


def lease_holder() -> str | None:
    """The heartbeat member this worker process records in every claim it makes (None
    outside a worker, or once the step stopped: the staleness rule alone applies then)."""
    return _holder


def _consumes(worker: Any) -> WorkerSlots:
    """The task queues this worker consumes now (``cancel_consumer`` / ``add_consumer``
    deselect and select the app's queues; a paused intake offers nothing) and its pool
    size now, read at every renewal."""
    try:
        queues = tuple(sorted(worker.app.amqp.queues.consume_from))
    except AttributeError:
        queues = ()
    pool = getattr(worker, "pool", None)
    size = getattr(pool, "num_processes", None) if pool is not None else None
    return WorkerSlots(queues, int(size or getattr(worker, "concurrency", 0) or 0))


class Intake:
    """Pauses and resumes consumption as ``Liveness.may_take_work`` says (why:
    docs/decisions.md, "Workers"), as ``cancel_consumer`` / ``add_consumer`` do, on the
    consumer's own thread (``Consumer.call_soon``). The queues are also deselected from
    the app's list, so a consumer restarted after a broker reconnect stays paused; kombu
    hands back a message a pending read returns after the cancel. Nothing acts once the
    stop began (Celery cancels the consumer then); a scheduled resume checks again."""

    def __init__(self, worker: Any, liveness: Liveness, queues: tuple[str, ...]) -> None:
        self.worker = worker
        self.liveness = liveness
        self.queues = queues
        self.paused = False  # decided after each renewal (the renewal thread)
        self.applied = False  # whether the consumer is paused now (the consumer's thread)
        # What the pause took away: an operator's cancel_consumer before it stays in force.
        self.resume: tuple[str, ...] = queues

    def follow(self, at_once: bool = False) -> None:
        """After a tick: decide pause or resume. Until the consumer's thread has carried
        the decision out, every tick asks again (:meth:`apply` is idempotent): while
        Celery reconnects to the broker its event loop stands still and a callback may be
        lost with the connection. ``at_once``: the consumer has not started yet."""
        if self.liveness.stopping:
            return
        paused = not self.liveness.may_take_work
        if paused != self.paused:
            self.paused = paused
            member = self.liveness.member
            with fork_guard:
                if paused:
                    log_event(log, "worker.consuming_paused", logging.WARNING, member=member)
                else:
                    log_event(log, "worker.consuming_resumed", member=member)
        if self.paused == self.applied:
            return
        if at_once:
            self.apply()
        else:
            self._soon(self.apply)

    def _soon(self, action: Callable[[], None]) -> None:
        consumer = getattr(self.worker, "consumer", None)
        if consumer is not None:
            consumer.call_soon(action)

    def apply(self) -> None:
        """Bring the consumer to the latest decision (on the consumer's thread; any number,
        in any order). Nothing once the stop began."""
        consumer = self.worker.consumer
        if consumer is None or self.liveness.stopping:
            return
        if self.paused and not self.applied:
            self._pause(consumer)
        elif not self.paused and self.applied:
            self._resume(consumer)

    def _pause(self, consumer: Any) -> None:
        """Stop consuming every task queue."""
        queues = consumer.app.amqp.queues
        if queues.consume_from is queues:  # nothing selected means "all": say which
            queues.select(list(queues))
        self.resume = tuple(name for name in self.queues if name in queues.consume_from)
        for name in self.resume:
            if consumer.task_consumer is None:
                queues.deselect(name)
            else:
                consumer.cancel_task_queue(name)
        self.applied = True

    def _resume(self, consumer: Any) -> None:
        """Consume again the task queues the pause took away."""
        if consumer.blueprint.state in (bootsteps.CLOSE, bootsteps.TERMINATE):
            return  # Celery is stopping the consumer
        queues = consumer.app.amqp.queues
        for name in self.resume:
            if consumer.task_consumer is None:
                queues.select_add(queues[name])
            else:
                consumer.add_task_queue(name)
        self.applied = False
        self.liveness.offer_now()


RENEWALS = "teamdesk-liveness"
CHECKS = "teamdesk-liveness-database"


class Renewals:
    """Calls ``tick`` every ``interval_s`` on a thread of its own until stopped (``at_once``:
    the first call right away): one for the renewals, one for the database checks
    (``name`` CHECKS), so a hung check never delays a renewal. A tick that raises is
    logged; the next comes on time."""

    def __init__(
        self,
        tick: Callable[[], None],
        interval_s: float,
        name: str = RENEWALS,
        at_once: bool = False,
    ) -> None:
        self._tick = tick
        self._interval_s = interval_s
        self._first_s = 0.0 if at_once else interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        wait_s = self._first_s
        while not self._stopped.wait(wait_s):
            wait_s = self._interval_s
            try:
                self._tick()
            except Exception as exc:  # a dead renewal thread would look like a dead worker
                with fork_guard:
                    error = type(exc).__name__
                    log_event(log, "heartbeat.failed", logging.ERROR, error=error, stage="tick")

    def stop(self, wait_s: float = 0.0) -> None:
        """No tick starts after this; one under way is waited for up to ``wait_s``. One
        that outlasts it does no harm: the tombstone refuses a late renewal, and a check
        that ends after the stop changes nothing."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait_s)


class LivenessStep(bootsteps.StartStopStep):
    """Runs the renewals and the database checks (:class:`Renewals`) and the intake
    (:class:`Intake`). The member is chosen when the worker is built, before the pool
    forks, so the pool's children record it in every claim (``lease_holder``)."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, teamdesk_renew_visibility: bool = True, **kwargs: Any) -> None:
        global _current, _holder
        super().__init__(parent, **kwargs)
        consumes = _consumes(parent)
        self.liveness = Liveness(
            get_settings(),
            held_delivery_tags,
            renew_visibility=teamdesk_renew_visibility,
            consumes=consumes,
            offer=lambda: _consumes(parent),
        )
        self.intake = Intake(parent, self.liveness, consumes.queues)
        self.renewals: Renewals | None = None
        self.checks: Renewals | None = None
        self.wake: Any = None
        _current = self.liveness
        _holder = self.liveness.member  # chosen before the pool forks: children inherit it

    def start(self, parent: Any) -> None:
        # The consumer starts after this step, so a worker whose first renewal or check
        # failed (or hung past CHECK_WAIT_S) starts paused.
        interval_s = renew_interval_s(self.liveness.settings)
        self.checks = Renewals(self.liveness.check_database, interval_s, CHECKS, at_once=True)
        self.checks.start()
        self.liveness.tick()
        self.liveness.checked.wait(CHECK_WAIT_S)
        self.intake.follow(at_once=True)
        self.renewals = Renewals(self.tick, interval_s)
        self.renewals.start()
        # The event loop sleeps until its next timer (up to 1 s) and a signal does not cut
        # that short: a no-op timer every WAKE_S starts a SIGTERM's drain within WAKE_S.
        self.wake = parent.timer.call_repeatedly(WAKE_S, _noop, priority=0)

    def tick(self) -> None:
        """One renewal (on the renewal thread), then the intake's decision."""
        self.liveness.tick()
        self.intake.follow()

    def stop(self, parent: Any) -> None:
        self._end(draining=False)

    def terminate(self, parent: Any) -> None:
        """A cold shutdown (and every ``celery.contrib.testing`` worker's end). The default
        acts only on ``self.obj`` (none here): the renewal thread ran on past the worker.
        This step ends before the pool's, whose children may still run, so the member
        stays a lease holder until it expires, one TTL on."""
        self._end(draining=True)

    def _end(self, draining: bool) -> None:
        """Stop both threads and remove the member. A check under way is waited for only
        after the removal, within its own bounds: a hung one cannot be cut short."""
        global _holder
        checks, self.checks = self.checks, None
        if checks is not None:
            checks.stop()
        if self.renewals is not None:
            self.renewals.stop(STOP_WAIT_S)
            self.renewals = None
        if self.wake is not None:
            self.wake.cancel()
            self.wake = None
        self.liveness.stop(draining=draining)
        _holder = None
        if checks is not None:
            checks.stop(CHECK_WAIT_S)

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
