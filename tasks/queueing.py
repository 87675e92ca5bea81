"""The queue side of a task: message ids, queued markers, publishing, progress events.

Only the dispatcher publishes (docs/design.md, "Dispatch"). It stamps a run's
``dispatched_at`` in the ledger first, then publishes the window's messages in one batch
(one round trip to a Redis broker), then sets each run's *queued marker*
``<prefix>:queued:<id>-<run>`` to that stamp. A worker ends the marker once it has
claimed the run (below). A published run that is still WAITING while its marker is
missing or carries another stamp has lost its message (a Redis restart, a dispatcher
killed between the stamp and the send, ...): the dispatcher publishes it again.

The marker is set *after* the send: a dispatcher killed in between leaves a message with
no marker, which costs a duplicate message (the lease absorbs it), never a run stranded
behind a marker whose message was never sent. A worker can be quicker than that, so a
message that has been claimed (or whose claim failed) does not delete its marker but
turns it into an *ended record*, ``ended <stamp> [<stamp> ...]``, kept ``ENDED_TTL_S``:
a marker the dispatcher sets late for one of those stamps is not set, and after a failed
claim the run is published again rather than stranded behind a marker for a message
that has ended (a marker carrying another publish's stamp stays: that message stands).
Markers live ``MARKER_TTL_FACTOR`` x ``STALE_AFTER_S``: far longer than a message waits
in a window of two messages per worker process, and short enough that a message lost
while its marker survived (a worker killed between taking it off the list and
registering it as unacknowledged) is published again within minutes.
"""

from __future__ import annotations

import logging
import threading
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
from teamdesk.config import Settings, get_settings, is_redis_url
from teamdesk.redis_client import redis_client

log = logging.getLogger("teamdesk.queue")

MARKER_TTL_FACTOR = 5  # a marker lives this many STALE_AFTER_S
# An ended record only has to outlive its message's late marker write (one pipeline just
# after the send, retried once within MARKER_TIMEOUT_S).
ENDED_TTL_S = 60
MARKER_TIMEOUT_S = 5

_client: redis.Redis | None = None
_client_url: str | None = None
_client_lock = threading.Lock()


def message_id(task_id: uuid.UUID | str, run: int) -> str:
    return f"{task_id}-{run}"


def marker_key(task_id: uuid.UUID | str, run: int, prefix: str | None = None) -> str:
    prefix = prefix or get_settings().queue_prefix
    return f"{prefix}:queued:{message_id(task_id, run)}"


def marker_ttl_s(settings: Settings) -> int:
    return max(60, round(MARKER_TTL_FACTOR * settings.stale_after_s))


def marker_redis() -> redis.Redis:
    """The broker's Redis when the broker is Redis (same failure domain), else REDIS_URL."""
    global _client, _client_url
    settings = get_settings()
    url = settings.broker_url if is_redis_url(settings.broker_url) else settings.redis_url
    with _client_lock:
        if _client is None or _client_url != url:
            _client = redis_client(settings, url, MARKER_TIMEOUT_S, retries=1)
            _client_url = url
        return _client


# KEYS: the marker. ARGV: the message's stamp, ENDED_TTL_S. The message no longer stands
# for its run. A marker of another publish stays (that message stands); otherwise the
# marker becomes (or is added to) the ended record "ended <stamp> <stamp> ...", so that a
# marker the dispatcher sets for this message later (it sets markers just after the send,
# and a worker can be quicker; a retried pipeline may set one again) is not set.
_MESSAGE_ENDED = """
local current = redis.call('GET', KEYS[1])
local ended = 'ended'
if current then
  if string.sub(current, 1, 6) == 'ended ' then
    ended = current
  elseif current ~= ARGV[1] then
    return 0
  end
end
if not string.find(ended .. ' ', ' ' .. ARGV[1] .. ' ', 1, true) then
  ended = ended .. ' ' .. ARGV[1]
end
redis.call('SET', KEYS[1], ended, 'EX', ARGV[2])
return 1
"""

# KEYS: the marker. ARGV: the publish's stamp, the marker TTL. Set unless that very
# message has already ended.
_SET_MARKER = """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, 6) == 'ended '
    and string.find(current .. ' ', ' ' .. ARGV[1] .. ' ', 1, true) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


def message_started(task_id: uuid.UUID, run: int, stamp: str | None = None) -> None:
    """The run is claimed (or could not be): this message no longer stands for it. Its
    marker is replaced by the ended record, unless it carries another publish's stamp
    (that message stands); see the module's docstring."""
    try:
        key = marker_key(task_id, run)
        if stamp is None:
            marker_redis().delete(key)
        else:
            marker_redis().eval(_MESSAGE_ENDED, 1, key, stamp, ENDED_TTL_S)
    except redis.RedisError:
        # Rarely costly: after a failed claim the marker outlives its message until it
        # expires (MARKER_TTL_FACTOR x STALE_AFTER_S), then the run is published again.
        log.debug("queued marker not ended", extra={"task_id": str(task_id), "run": run})


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
    # The run's trace (teamdesk/tracing.py): this publish is its row's span's child, or
    # for a recovered run the first of a new trace linked to it; the worker continues it
    # from the message's header. Off: nothing.
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


def set_markers(runs: Sequence[RunRef], settings: Settings) -> None:
    """Say "the broker holds this run's message, sent with this stamp" (one round trip),
    except for a message that has already ended (see the module's docstring)."""
    if not runs:
        return
    ttl = marker_ttl_s(settings)
    with marker_redis().pipeline(transaction=False) as pipe:
        for run in runs:
            key = marker_key(run.task_id, run.run, settings.queue_prefix)
            pipe.eval(_SET_MARKER, 1, key, stamp_text(run), ttl)  # EVAL: no NOSCRIPT round trip
        pipe.execute()


def marker_matches(runs: Sequence[RunRef], settings: Settings) -> list[bool]:
    """For each run: does its marker carry the stamp its row carries (one round trip)?"""
    if not runs:
        return []
    with marker_redis().pipeline(transaction=False) as pipe:
        for run in runs:
            pipe.get(marker_key(run.task_id, run.run, settings.queue_prefix))
        values = pipe.execute()
    return [
        value is not None and canonical_stamp(value.decode()) == stamp_text(run)
        for run, value in zip(runs, values, strict=True)
    ]


def stamp_text(run: RunRef) -> str:
    """The stamp as a message carries it (and its marker): always in UTC, whatever the
    ``TimeZone`` of the session that read it, so one publish has one text in every
    dispatcher and every scan (the markers' scripts compare it as text)."""
    return run.stamp.astimezone(UTC).isoformat() if run.stamp is not None else ""


def canonical_stamp(text: str) -> str:
    """A stamp read back (a marker's, a message's) as :func:`stamp_text` renders it, so
    that it is compared as a timestamp: written with another UTC offset (an earlier
    release rendered the session's), it is still the same publish. Anything else (an
    ended record, not a stamp) is returned unchanged."""
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return text
    return stamp.astimezone(UTC).isoformat() if stamp.tzinfo is not None else text


def report_progress(task: Task, percent: int, done: int, total: int) -> None:
    """Progress for Flower, as a :data:`PROGRESS_EVENT` event: Flower builds its view from
    events and shows the event's ``result`` field (custom fields and ``update_state`` meta
    are not shown), beside the state the task's own events give (STARTED while it runs;
    the event's name keeps it from ever changing the state: tasks/names.py). The result
    backend is not written: the ledger is where programs read progress (the API and the
    CLI), and a backend write would cost a read and a write per batch."""
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
