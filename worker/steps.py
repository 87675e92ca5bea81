"""The worker bootstep that keeps a worker process's liveness in Redis (see liveness.py),
checks its database on a thread of its own, and takes messages only while that liveness
is registered and a check succeeded recently."""

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
    """The task queues this worker consumes now and its pool size now: the dispatcher
    sizes each queue's window from what live workers offer. Read at every renewal, so the
    window follows Celery's own controls: ``-Q`` at start, ``cancel_consumer`` /
    ``add_consumer`` (they deselect and select the app's queues), ``autoscale`` and
    ``pool_grow`` / ``pool_shrink`` (the pool's size); a paused intake offers nothing."""
    try:
        queues = tuple(sorted(worker.app.amqp.queues.consume_from))
    except AttributeError:
        queues = ()
    pool = getattr(worker, "pool", None)
    size = getattr(pool, "num_processes", None) if pool is not None else None
    return WorkerSlots(queues, int(size or getattr(worker, "concurrency", 0) or 0))


class Intake:
    """Whether this worker takes messages: only while its heartbeat is registered and a
    database check succeeded recently (``Liveness.may_take_work``).

    Every claim records this process's member as the lease holder, and the dispatcher
    takes back a run whose holder it cannot find (docs/design.md, "Heartbeats"). A worker
    that cannot renew (Redis refuses writes) would otherwise claim runs only to have each
    one recovered, until ``MAX_RECOVERIES`` failed it; one that cannot open a connection
    (PostgreSQL refuses new ones while pooled ones still work; a pooler's queue holds its
    check) would fail or hang on every claim. So a failed renewal or check (or one that
    hangs past its bound) stops consumption, both succeeding again resumes it, each logged
    once (``worker.consuming_paused`` / ``worker.consuming_resumed``). The in-flight tasks
    go on; only new messages wait.

    How, in Celery's terms: what Celery's own ``cancel_consumer`` / ``add_consumer``
    remote-control commands do - ``Consumer.cancel_task_queue`` / ``add_task_queue``,
    scheduled with ``Consumer.call_soon`` so they run on the consumer's own thread (the
    event loop). The queues are also deselected from the app's queue list, so a consumer
    restarted after a broker reconnect stays paused. A message a pending read returns
    after the cancel is handed back to the broker by kombu. Warm shutdown: nothing here
    acts once the stop began (the consumer is cancelled by Celery itself then), and a
    resume already scheduled checks again when it runs.
    """

    def __init__(self, worker: Any, liveness: Liveness, queues: tuple[str, ...]) -> None:
        self.worker = worker
        self.liveness = liveness
        self.queues = queues
        self.paused = False  # decided after each renewal (the renewal thread)
        self.applied = False  # whether the consumer is paused now (the consumer's thread)
        # What the pause took away: an operator's cancel_consumer before it stays in force.
        self.resume: tuple[str, ...] = queues

    def follow(self, at_once: bool = False) -> None:
        """After a tick: pause when the heartbeat is not registered or no database check
        succeeded recently enough, resume once both hold. Until the consumer's thread has
        carried the decision out, every tick asks it again (:meth:`apply` is idempotent):
        while Celery reconnects to the broker its event loop stands still, decisions pile
        up, and a callback may be lost with the connection. ``at_once``: the consumer has
        not started yet (the worker's own thread)."""
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
        """Bring the consumer to the latest decision (on the consumer's thread): however
        many of these run, in whatever order, each pauses or resumes only when the
        consumer is not yet as decided. Nothing once the stop began."""
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
    the first call right away). Two of them per worker: the renewals, and the database
    checks (``name`` CHECKS), so a check that hangs never delays a renewal.

    Not on Celery's timer: the timer runs on the event loop, which stands still while the
    consumer retries a lost broker connection (worker/liveness.py). A tick never raises;
    should one, the failure is logged and the next tick comes on time."""

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
        """No tick starts after this; one under way is waited for, up to ``wait_s`` (a
        renewal's calls are bounded, RENEW_TIMEOUT_S each), so nothing of this worker runs
        on after its stop. Should one outlast that, the heartbeat's tombstone still
        refuses a renewal that comes after the removal, and a database check that ends
        after the stop changes and logs nothing (``Liveness.check_database``)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait_s)


class LivenessStep(bootsteps.StartStopStep):
    """Renews the heartbeat member and message visibility on a thread of its own
    (:class:`Renewals`), checks the database on another, and lets the worker take messages
    only while the member is registered and a check succeeded recently (:class:`Intake`).

    The member is chosen when the worker is built, before the pool forks, so the pool's
    children record it in every claim (``lease_holder``) and the dispatcher can tell
    when the process holding a lease is gone.
    """

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
        # The consumer starts after this step: a worker whose first renewal or check failed
        # starts without consuming, and no message reaches it before its member is
        # registered. The first check runs beside the first renewal; the start waits for
        # it within a check's own bounds (CHECK_WAIT_S), so a hung one starts it paused.
        interval_s = renew_interval_s(self.liveness.settings)
        self.checks = Renewals(self.liveness.check_database, interval_s, CHECKS, at_once=True)
        self.checks.start()
        self.liveness.tick()
        self.liveness.checked.wait(CHECK_WAIT_S)
        self.intake.follow(at_once=True)
        self.renewals = Renewals(self.tick, interval_s)
        self.renewals.start()
        # The worker's event loop sleeps until its next timer, up to 1 s, and a signal
        # does not cut that sleep short; a no-op timer every WAKE_S makes a SIGTERM start
        # the drain within WAKE_S instead (an idle worker then exits about 0.8 s sooner).
        self.wake = parent.timer.call_repeatedly(WAKE_S, _noop, priority=0)

    def tick(self) -> None:
        """One renewal (on the renewal thread); a pause or resume it decides is carried
        out on the consumer's own thread (``Consumer.call_soon`` wakes the event loop)."""
        self.liveness.tick()
        self.intake.follow()

    def stop(self, parent: Any) -> None:
        self._end(draining=False)

    def terminate(self, parent: Any) -> None:
        """A cold shutdown (and every ``celery.contrib.testing`` worker's end): Celery's
        blueprint calls ``terminate`` then, whose default acts only on ``self.obj``, which
        this step has none of; the renewal thread ran on past the worker. This step ends
        before the pool's, whose children may still be running: the member leaves the
        active sets but stays a lease holder until it expires, one TTL on, so no run of a
        child that is still alive is taken over (the warm stop's drain does the same)."""
        self._end(draining=True)

    def _end(self, draining: bool) -> None:
        """Stop both threads and remove the member. A database check under way is waited
        for only after the removal, and only within its own bounds: one hung in DNS or a
        pooler's queue cannot be cut short (it ends with the process, changing nothing)."""
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
