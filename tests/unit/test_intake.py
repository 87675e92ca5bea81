"""The worker's intake (worker/life.py, ``Intake``) follows the renewals from the renewal
thread and is carried out on the consumer's thread. While Celery reconnects to the broker
that thread stands still, so several decisions can pile up before any runs, and they run
in no set order (kombu's hub keeps them in a set). However they pile up, the consumer ends
as the last decision says, and a resume brings back the queues the pause took away.

A real Celery app's queue list (``app.amqp.queues``) and a consumer that has not started
(``task_consumer`` is None, as after a lost connection); the consumer's thread is played
by running the scheduled callbacks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, bootsteps
from kombu import Queue

from worker.life import Intake

QUEUES = ("exports", "reminders")


@dataclass
class FakeLiveness:
    may_take_work: bool = True
    stopping: bool = False
    member: str = "test-host/1"
    offers: int = 0

    def offer_now(self) -> None:
        self.offers += 1


@dataclass
class FakeConsumer:
    app: Celery
    task_consumer: Any = None
    pending: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.blueprint = type("Blueprint", (), {"state": bootsteps.RUN})()

    def call_soon(self, action: Callable[[], None]) -> None:
        self.pending.append(action)


def consumer_of(queues: tuple[str, ...] = QUEUES) -> FakeConsumer:
    app = Celery(set_as_current=False)
    app.conf.task_queues = [Queue(name) for name in queues]
    app.amqp.queues.select(list(queues))
    return FakeConsumer(app)


def consuming(consumer: FakeConsumer) -> set[str]:
    return set(consumer.app.amqp.queues.consume_from)


def intake_for(consumer: FakeConsumer, liveness: FakeLiveness) -> Intake:
    worker = type("Worker", (), {"consumer": consumer})()
    return Intake(worker, liveness, QUEUES)  # type: ignore[arg-type]


def tick(intake: Intake, liveness: FakeLiveness, registered: bool) -> None:
    liveness.may_take_work = registered
    intake.follow()


@pytest.mark.parametrize("backwards", [False, True])
def test_decisions_piled_up_end_as_the_last_one_says(backwards: bool) -> None:
    """Paused; then, before the consumer's thread runs anything: registered, failed,
    registered again. Whatever order the callbacks run in, the worker consumes both queues
    again, and offers them once."""
    consumer, liveness = consumer_of(), FakeLiveness()
    intake = intake_for(consumer, liveness)
    tick(intake, liveness, registered=False)
    for action in consumer.pending:
        action()
    consumer.pending.clear()
    assert consuming(consumer) == set()

    for registered in (True, False, True):
        tick(intake, liveness, registered)
    for action in reversed(consumer.pending) if backwards else list(consumer.pending):
        action()
    assert consuming(consumer) == set(QUEUES)
    assert intake.paused is False
    assert liveness.offers == 1  # one resume, one offer


def test_a_pause_piled_up_last_ends_paused_and_resumes_both_queues_later() -> None:
    """Failed, registered, failed before the consumer's thread runs anything. Before, the
    second pause rebuilt the queues to resume from the list the first had emptied: the
    worker logged consuming_resumed at the next renewal but consumed nothing, for good."""
    consumer, liveness = consumer_of(), FakeLiveness()
    intake = intake_for(consumer, liveness)
    for registered in (False, True, False):
        tick(intake, liveness, registered)
    for action in reversed(consumer.pending):
        action()
    consumer.pending.clear()
    assert consuming(consumer) == set()
    tick(intake, liveness, registered=True)
    for action in consumer.pending:
        action()
    assert consuming(consumer) == set(QUEUES)


def test_a_lost_callback_is_asked_for_again_at_the_next_tick() -> None:
    consumer, liveness = consumer_of(), FakeLiveness()
    intake = intake_for(consumer, liveness)
    tick(intake, liveness, registered=False)
    consumer.pending.clear()  # lost with the connection, never run
    assert consuming(consumer) == set(QUEUES)
    tick(intake, liveness, registered=False)
    assert len(consumer.pending) == 1
    consumer.pending[0]()
    assert consuming(consumer) == set()
    consumer.pending.clear()
    tick(intake, liveness, registered=False)
    assert consumer.pending == []  # carried out: nothing more to ask


def test_an_operators_cancelled_queue_stays_cancelled_after_a_resume() -> None:
    consumer, liveness = consumer_of(), FakeLiveness()
    consumer.app.amqp.queues.deselect("reminders")  # celery control cancel_consumer
    intake = intake_for(consumer, liveness)
    for registered in (False, True):
        tick(intake, liveness, registered)
        for action in consumer.pending:
            action()
        consumer.pending.clear()
    assert consuming(consumer) == {"exports"}


def test_nothing_changes_once_the_stop_began() -> None:
    consumer, liveness = consumer_of(), FakeLiveness()
    intake = intake_for(consumer, liveness)
    tick(intake, liveness, registered=False)
    liveness.stopping = True
    for action in consumer.pending:
        action()
    assert consuming(consumer) == set(QUEUES)
