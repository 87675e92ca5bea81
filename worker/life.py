"""A worker process's life, owned by one object (docs/design.md, "Heartbeats" and
"Shutdown"): :class:`WorkerLife` goes STARTING -> CONSUMING <-> PAUSED -> DRAINING ->
STOPPED. One renewal thread runs for the whole life, drain included: it renews the
heartbeat and decides the intake while the worker consumes, and renews the lease holder
while it drains. The database check runs on a thread of its own (worker/liveness.py says
why). The stop after SIGTERM is bounded by ``SHUTDOWN_TIMEOUT_S``: Celery leaves a warm
shutdown unbounded, so past the budget this sends SIGQUIT (Celery's cold path), and
``HARD_EXIT_AFTER_S`` later ends the process.

The bootstep (:class:`LifeStep`) builds the life when the worker is built, before the
pool forks, so the pool's children record its member in every claim (``lease_holder``);
worker/lifecycle.py hands it Celery's signals.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from teamdesk.config import get_settings
from teamdesk.heartbeat import WorkerSlots
from teamdesk.logs import log_event
from worker.forking import fork_guard
from worker.liveness import CHECK_S, RENEW_TIMEOUT_S, Liveness, renew_interval_s

log = logging.getLogger("teamdesk.worker")

WAKE_S = 0.1
# How long a stop waits for a renewal under way: two Redis calls.
STOP_WAIT_S = 2 * RENEW_TIMEOUT_S + 1.0
# How long a stop waits for a database check under way, and the start for the first one:
# a check within libpq's bounds. A hung one is not waited for longer.
CHECK_WAIT_S = CHECK_S + 1.0
HARD_EXIT_AFTER_S = 10.0  # after the cold shutdown was requested, if the process still lives

RENEWALS = "teamdesk-liveness"
CHECKS = "teamdesk-liveness-database"


class State(enum.Enum):
    STARTING = "starting"
    CONSUMING = "consuming"
    PAUSED = "paused"  # alive, taking no new messages (a failed renewal or check)
    DRAINING = "draining"  # stopping: running tasks finish, the holder is renewed
    STOPPED = "stopped"


def _noop() -> None:
    """Nothing: the timer exists to bound the event loop's sleep (see WorkerLife.start)."""


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


class Loop:
    """Calls ``tick`` every ``interval_s`` on a thread of its own until stopped (``at_once``:
    the first call right away). A tick that raises is logged; the next comes on time."""

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
        """After a renewal: decide pause or resume. Until the consumer's thread has carried
        the decision out, every renewal asks again (:meth:`apply` is idempotent): while
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
            consumer = getattr(self.worker, "consumer", None)
            if consumer is not None:
                consumer.call_soon(self.apply)

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


class WorkerLife:
    """One worker process's life (see the module's docstring). Built empty at import, so
    Celery's signals find it whatever comes first; :meth:`attach` gives it a worker.

    The stop's outcome: ``clean`` unless the budget passed (``escalated``), an operator
    stopped cold during the drain, or Celery logged an unrecoverable error (``crashed``);
    worker/lifecycle.py turns it into the exit code."""

    def __init__(self) -> None:
        self._phase = State.STOPPED  # STARTING, CONSUMING, DRAINING or STOPPED (see state)
        self.liveness: Liveness | None = None
        self.intake: Intake | None = None
        self.holder: str | None = None  # the member the pool's children record in claims
        self._renewals: Loop | None = None
        self._checks: Loop | None = None
        self._wake: Any = None
        self._new_stop()
        self.crashed = False  # Celery logged an unrecoverable error (worker/lifecycle.py)

    def _new_stop(self) -> None:
        self.drain_started = threading.Event()
        self.finished = threading.Event()
        self.escalated = threading.Event()
        self.cold_during_drain = False
        self._timers: list[threading.Timer] = []

    # -- start ---------------------------------------------------------------------------

    def attach(self, worker: Any) -> None:
        """Build the liveness for ``worker`` (when Celery builds it, before the pool forks)."""
        consumes = _consumes(worker)
        self.liveness = Liveness(get_settings(), consumes=consumes, offer=lambda: _consumes(worker))
        self.intake = Intake(worker, self.liveness, consumes.queues)
        self.holder = self.liveness.member  # chosen before the pool forks: children inherit it
        self._phase = State.STARTING
        self._new_stop()

    @property
    def state(self) -> State:
        """The phase, PAUSED instead of CONSUMING while the intake is paused."""
        paused = self.intake is not None and self.intake.paused
        return State.PAUSED if self._phase is State.CONSUMING and paused else self._phase

    def start(self, worker: Any) -> None:
        """Before the consumer starts: the first check and renewal, so a worker whose first
        renewal or check failed (or hung past CHECK_WAIT_S) starts paused; then the two
        threads."""
        liveness, intake = self._attached()
        interval_s = renew_interval_s(liveness.settings)
        self._checks = Loop(liveness.check_database, interval_s, CHECKS, at_once=True)
        self._checks.start()
        liveness.tick()
        liveness.checked.wait(CHECK_WAIT_S)
        intake.follow(at_once=True)
        self._phase = State.CONSUMING
        self._renewals = Loop(self._tick, interval_s)
        self._renewals.start()
        # The event loop sleeps until its next timer (up to 1 s) and a signal does not cut
        # that short: a no-op timer every WAKE_S starts a SIGTERM's drain within WAKE_S.
        self._wake = worker.timer.call_repeatedly(WAKE_S, _noop, priority=0)

    def _attached(self) -> tuple[Liveness, Intake]:
        assert self.liveness is not None and self.intake is not None, "attach() first"
        return self.liveness, self.intake

    def _tick(self) -> None:
        """One renewal, on the renewal thread: the holder while draining, else the heartbeat
        and then the intake's decision."""
        liveness, intake = self._attached()
        if self._phase is State.DRAINING:
            liveness.drain_tick()  # logs its failures itself and keeps trying
            return
        liveness.tick()
        intake.follow()

    # -- stop ----------------------------------------------------------------------------

    def drain(self, signal_name: str | None) -> None:
        """A warm stop began (SIGTERM, SIGINT, ``celery control shutdown``): leave the
        active sets, stay a lease holder, renewed until :meth:`end`, and arm the budget."""
        self.drain_started.set()
        settings = get_settings()
        log_event(log, "worker.stopping", signal=signal_name, budget_s=settings.shutdown_timeout_s)
        if self.liveness is not None:
            self._phase = State.DRAINING
            self.liveness.stop(draining=True)
        self._arm(settings.shutdown_timeout_s, self._escalate)

    def stop_consuming(self, draining: bool) -> None:
        """Celery stops the bootstep: during a drain the renewals go on (the pool still runs
        tasks); otherwise both threads stop and the member is removed (``draining``: a cold
        stop, it stays a lease holder until it expires, one TTL on)."""
        if self._phase is State.DRAINING:
            return
        self._stop_threads(lambda: self._remove(draining))

    def end(self) -> None:
        """The worker stopped (Celery's ``worker_shutdown``): nothing of it is alive now."""
        self.finished.set()
        for timer in self._timers:
            timer.cancel()
        drained = self._phase is State.DRAINING
        self._stop_threads(lambda: None)
        if drained and self.liveness is not None:
            self.liveness.finish()

    def _remove(self, draining: bool) -> None:
        if self.liveness is not None:
            self.liveness.stop(draining=draining)

    def _stop_threads(self, remove: Callable[[], None]) -> None:
        """Stop both threads, then ``remove``; a check under way is waited for only after
        it, within its own bounds: a hung one cannot be cut short."""
        checks, self._checks = self._checks, None
        if checks is not None:
            checks.stop()
        renewals, self._renewals = self._renewals, None
        if renewals is not None:
            renewals.stop(STOP_WAIT_S)
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        remove()
        self.holder = None
        self._phase = State.STOPPED
        if checks is not None:
            checks.stop(CHECK_WAIT_S)

    def _arm(self, delay: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(delay, action)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _escalate(self) -> None:
        if self.finished.is_set():
            return
        self.escalated.set()
        log_event(
            log,
            "worker.shutdown_timeout",
            logging.ERROR,
            budget_s=get_settings().shutdown_timeout_s,
        )
        self._arm(HARD_EXIT_AFTER_S, self._hard_exit)
        os.kill(os.getpid(), signal.SIGQUIT)

    def _hard_exit(self) -> None:
        if not self.finished.is_set():
            log_event(log, "worker.stopped", logging.CRITICAL, exit_code=1, forced=True)
            logging.shutdown()
            os._exit(1)

    @property
    def clean(self) -> bool:
        return not (self.escalated.is_set() or self.cold_during_drain or self.crashed)


LIFE = WorkerLife()


def current_liveness() -> Liveness | None:
    """This process's liveness, once a worker was built (None outside a worker)."""
    return LIFE.liveness


def lease_holder() -> str | None:
    """The heartbeat member this worker process records in every claim it makes (None
    outside a worker, or once it stopped: the staleness rule alone applies then)."""
    return LIFE.holder


class LifeStep(bootsteps.StartStopStep):
    """Celery's handle on :data:`LIFE`: built with the worker, started before the
    consumer, stopped with the worker's blueprint."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        LIFE.attach(parent)

    def start(self, parent: Any) -> None:
        LIFE.start(parent)

    def stop(self, parent: Any) -> None:
        LIFE.stop_consuming(draining=False)

    def terminate(self, parent: Any) -> None:
        """A cold shutdown (and every ``celery.contrib.testing`` worker's end). The default
        acts only on ``self.obj`` (none here). This step ends before the pool's, whose
        children may still run, so the member stays a lease holder until it expires."""
        LIFE.stop_consuming(draining=True)

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
