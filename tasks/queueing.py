"""The queue side of a task: message ids, the queued marker, progress events, publishing.

The queued marker ``<prefix>:queued:<id>-<run>`` says "the broker holds a message for this
run". It is set before every publish of the run's message (the dispatch and each same-run
retry) and deleted when a worker starts on the message. The dispatcher re-publishes a
WAITING run only when the marker is gone, so a message merely waiting behind a backlog is
never duplicated (SPEC §7 step 4).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import redis
from celery import Celery, Task
from celery.exceptions import Retry

from tasks.celery_app import QUEUE_OF, TASK_OF_KIND
from teamdesk.config import get_settings

log = logging.getLogger("teamdesk.queue")

MARKER_TTL_S = 7 * 24 * 3600  # garbage bound only; markers are deleted when work starts

_client: redis.Redis | None = None
_client_url: str | None = None
_client_lock = threading.Lock()
_lease_holder: str | None = None


def message_id(task_id: uuid.UUID | str, run: int) -> str:
    return f"{task_id}-{run}"


def marker_key(task_id: uuid.UUID | str, run: int, prefix: str | None = None) -> str:
    prefix = prefix or get_settings().queue_prefix
    return f"{prefix}:queued:{message_id(task_id, run)}"


def marker_redis() -> redis.Redis:
    """The broker's Redis when the broker is Redis (same failure domain), else REDIS_URL."""
    global _client, _client_url
    settings = get_settings()
    url = settings.broker_url if settings.broker_url.startswith("redis") else settings.redis_url
    with _client_lock:
        if _client is None or _client_url != url:
            _client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
            _client_url = url
        return _client


def set_lease_holder(member: str | None) -> None:
    """The heartbeat member of this worker process, recorded by every claim it makes."""
    global _lease_holder
    _lease_holder = member


def lease_holder() -> str | None:
    return _lease_holder


def message_started(task_id: uuid.UUID, run: int) -> None:
    try:
        marker_redis().delete(marker_key(task_id, run))
    except redis.RedisError:
        # Harmless: a later publish of this run sets the marker again before it matters.
        log.debug("queued marker not deleted", extra={"task_id": str(task_id), "run": run})


@contextmanager
def retry_marker(task_id: uuid.UUID, run: int) -> Iterator[None]:
    """Set the marker around a same-run retry; remove it again if the retry was not sent."""
    key = marker_key(task_id, run)
    marker_redis().set(key, "1", ex=MARKER_TTL_S)
    try:
        yield
    except Retry:
        raise
    except BaseException:
        marker_redis().delete(key)
        raise


def publish(app: Celery, task_id: uuid.UUID, run: int, kind: str) -> None:
    """Publish the run's message with id ``{id}-{run}``; raises when the broker refused it."""
    name = TASK_OF_KIND[kind]
    key = marker_key(task_id, run)
    client = marker_redis()
    client.set(key, "1", ex=MARKER_TTL_S)
    try:
        app.send_task(
            name, args=[str(task_id), run], task_id=message_id(task_id, run), queue=QUEUE_OF[name]
        )
    except BaseException:
        client.delete(key)
        raise


class PublishFailed(Exception):
    """Publishing stopped at the first failure; ``published`` messages went out before it."""

    def __init__(self, published: int, error: str) -> None:
        super().__init__(f"publish failed after {published} messages ({error})")
        self.published, self.error = published, error


def publish_many(app: Celery, runs: Sequence[tuple[uuid.UUID, int, str]]) -> int:
    """Publish several runs: their markers in one round trip, the messages on one producer
    connection. Raises PublishFailed (markers of the unsent runs removed) on the first error."""
    if not runs:
        return 0
    client = marker_redis()
    keys = [marker_key(task_id, run) for task_id, run, _ in runs]
    sent = 0
    try:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.set(key, "1", ex=MARKER_TTL_S)
            pipe.execute()
        with app.producer_or_acquire() as producer:
            for task_id, run, kind in runs:
                name = TASK_OF_KIND[kind]
                app.send_task(
                    name,
                    args=[str(task_id), run],
                    task_id=message_id(task_id, run),
                    queue=QUEUE_OF[name],
                    producer=producer,
                )
                sent += 1
    except Exception as exc:
        with suppress(redis.RedisError):
            client.delete(*keys[sent:])
        raise PublishFailed(sent, type(exc).__name__) from exc
    return sent


def marker_present(task_id: uuid.UUID, run: int) -> bool:
    return bool(marker_redis().exists(marker_key(task_id, run)))


def report_progress(task: Task, percent: int, done: int, total: int) -> None:
    """Progress for Flower, as a ``task-progress`` event: Flower builds its view from events
    and shows the event's ``result`` field (custom fields and ``update_state`` meta are not
    shown). The result backend is not written: the ledger is where programs read progress
    (the API and the CLI), and a backend write would cost a read and a write per batch."""
    if task.request.called_directly:
        return
    task.send_event(
        "task-progress",
        result=f"{percent}% ({done}/{total} rows)",
        percent=percent,
        done=done,
        total=total,
    )
