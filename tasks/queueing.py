"""The queue side of a task: message ids, the dispatcher's batch publish, progress events
(docs/design.md, "Dispatch"). The publish's stamp rides in the message, always in UTC, so
a claim accepts that publish only (docs/design.md, "Lease")."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import redis
from celery import Celery, Task
from kombu.exceptions import KombuError
from kombu.transport.redis import BatchPublishError
from opentelemetry.trace import SpanKind

from ledger.dispatch import RunRef
from tasks.names import PROGRESS_EVENT, QUEUE_OF, QUEUE_OF_KIND, TASK_OF_KIND
from teamdesk import tracing
from teamdesk.config import is_redis_url

log = logging.getLogger("teamdesk.queue")


def message_id(task_id: uuid.UUID | str, run: int) -> str:
    return f"{task_id}-{run}"


class PublishFailed(Exception):
    """The broker refused the batch. ``sent`` messages certainly went out; with
    ``uncertain`` the rest may have too (a pipeline that failed while executing)."""

    def __init__(self, sent: int, error: str, uncertain: bool) -> None:
        super().__init__(f"publish failed after {sent} messages ({error})")
        self.sent, self.error, self.uncertain = sent, error, uncertain


def publish_batch(app: Celery, runs: Sequence[RunRef]) -> None:
    """Publish ``runs`` on one producer, in one batch where the transport can (one round
    trip for a Redis broker), in order. Raises PublishFailed."""
    if not runs:
        return
    amqp = app.amqp
    sent = 0
    try:
        with app.producer_or_acquire() as producer:
            # Declared once per batch, not once per message (kombu caches it anyway).
            for queue in {QUEUE_OF_KIND[r.kind] for r in runs}:
                producer.maybe_declare(amqp.queues[queue])
            with producer.batch(max_size=len(runs) + 1):
                for run in runs:
                    _send(amqp, producer, run)
                    sent += 1
    except BatchPublishError as exc:
        raise PublishFailed(0, type(exc.__cause__ or exc).__name__, uncertain=True) from exc
    except (KombuError, OSError, redis.RedisError) as exc:
        # A batch that never flushed sent nothing; a transport without batches sent the
        # messages before the one that failed.
        immediate = not _batches(app)
        raise PublishFailed(sent if immediate else 0, type(exc).__name__, False) from exc


def _send(amqp: object, producer: object, run: RunRef) -> None:
    name = TASK_OF_KIND[run.kind]
    args: list[object] = [str(run.task_id), run.run]
    if run.stamp is not None:
        args.append(stamp_text(run))  # the claim accepts this publish only (ledger/lease.py)
    message = amqp.create_task_message(  # type: ignore[attr-defined]
        message_id(run.task_id, run.run),
        name,
        args,
        {},
        argsrepr=repr(args),
        kwargsrepr="{}",
        create_sent_event=False,
        # The message's header overrides the task's option: say it, or the worker stores
        # every success in the result backend (tasks/definitions.py, ignore_result).
        ignore_result=True,
    )
    # The row's span's child, or for a recovered run a new trace linked to it
    # (docs/design.md, "Tracing").
    new_trace = run.recovered or run.trace_parent is None
    with tracing.span(
        f"publish {name}",
        parent=None if new_trace else run.trace_parent,
        root=new_trace,
        link=run.trace_parent if run.recovered else None,
        kind=SpanKind.PRODUCER,
        task_id=run.task_id,
        run=run.run,
        task_kind=run.kind,
        recovered=run.recovered,
    ) as current:
        if current is not None:
            message.headers[tracing.HEADER] = tracing.current_parent()
        amqp.send_task_message(producer, name, message, queue=QUEUE_OF[name], declare=[])  # type: ignore[attr-defined]


def _batches(app: Celery) -> bool:
    return is_redis_url(app.conf.broker_url or "")


def stamp_text(run: RunRef) -> str:
    """The stamp as a message carries it: in UTC whatever the reading session's
    ``TimeZone``, so one publish has one text in every dispatcher and every scan."""
    return run.stamp.astimezone(UTC).isoformat() if run.stamp is not None else ""


def canonical_stamp(text: str) -> str:
    """A message's stamp as :func:`stamp_text` renders it, so a stamp an earlier release
    wrote with another UTC offset is still the same publish. Anything else is returned
    unchanged."""
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return text
    return stamp.astimezone(UTC).isoformat() if stamp.tzinfo is not None else text


def report_progress(task: Task, percent: int, done: int, total: int) -> None:
    """Progress for Flower, as a :data:`PROGRESS_EVENT` event (docs/design.md, "Observe"):
    Flower shows its ``result`` field, not custom fields or ``update_state`` meta. The
    result backend is not written: programs read progress from the ledger, and a backend
    write would cost a read and a write per batch."""
    if task.request.called_directly:
        return
    try:
        task.send_event(
            PROGRESS_EVENT,
            result=f"{percent}% ({done}/{total} rows)",
            percent=percent,
            done=done,
            total=total,
        )
    except (KombuError, OSError, redis.RedisError) as exc:
        # Best effort: Flower misses this step, the ledger (written first) has it. A broker
        # restart must not fail the export (its attempts are for the task's own errors).
        log.warning(
            "progress event not sent: %s",
            type(exc).__name__,
            extra={"task_id": str(task.request.id), "percent": percent},
        )
