"""Reading what the broker holds: the Redis lists of our queues and kombu's unacked hash."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from ledger.dispatch import RunRef
from tasks.broker_view import UNACKED_KEY
from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE
from tasks.queueing import publish_batch
from teamdesk import db


def queue_key(prefix: str, queue: str) -> str:
    """The kombu Redis list of ``queue`` (every broker key carries the global prefix)."""
    return f"{prefix}:{queue}"


def queued(client: redis.Redis, prefix: str, queue: str) -> list[dict[str, Any]]:
    """The messages waiting in ``queue``, oldest first; each is kombu's JSON envelope."""
    raw = client.lrange(queue_key(prefix, queue), 0, -1)
    return [json.loads(item) for item in reversed(raw)]  # LPUSH + BRPOP: the tail is oldest


def queued_ids(client: redis.Redis, prefix: str, queue: str) -> list[str]:
    return [m["headers"]["id"] for m in queued(client, prefix, queue)]


def all_task_messages(client: redis.Redis, prefix: str) -> dict[str, list[str]]:
    return {q: queued_ids(client, prefix, q) for q in (EXPORTS_QUEUE, REMINDERS_QUEUE)}


def held_ids(client: redis.Redis, prefix: str) -> set[str]:
    """Message ids the broker holds: waiting in a task queue or delivered, unacknowledged."""
    waiting = {i for ids in all_task_messages(client, prefix).values() for i in ids}
    delivered = set()
    for entry in client.hvals(f"{prefix}:{UNACKED_KEY}"):
        message = json.loads(entry)[0]  # kombu's [message, exchange, routing key]
        message = json.loads(message) if isinstance(message, (str, bytes)) else message
        delivered.add(message["headers"]["id"])
    return waiting | delivered


def message_ids(rows: Iterable[tuple[uuid.UUID, int]]) -> list[str]:
    return sorted(f"{task_id}-{run}" for task_id, run in rows)


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def send_message(app: Celery, task_id: uuid.UUID, run: int, kind: str = "EXPORT") -> None:
    """Put one message for ``task_id``/``run`` on its queue with the run's current publish
    stamp, stamping an unpublished row first (the database's clock) as the dispatcher
    would: a first delivery in a test that runs no dispatcher, or a duplicate of the
    current publish. A finished row keeps its columns; its message carries a stamp no
    publish had."""
    with db.get_engine().begin() as conn:
        stamp = conn.execute(
            sa.text(
                "UPDATE background_tasks SET dispatched_at = CASE WHEN status = 'WAITING' "
                "THEN coalesce(dispatched_at, clock_timestamp()) ELSE dispatched_at END "
                "WHERE id = :id RETURNING coalesce(dispatched_at, created_at)"
            ),
            {"id": task_id},
        ).scalar_one()
    publish_batch(app, [RunRef(task_id, run, kind, stamp=stamp)])


def publish_stamped(
    engine: sa.Engine, app: Celery, task_id: uuid.UUID, run: int, kind: str = "EXPORT"
) -> datetime:
    """Publish the run the way the dispatcher does: stamp ``dispatched_at`` (the database's
    clock), then send a message that carries that stamp. Returns the stamp."""
    with engine.begin() as conn:
        stamp = conn.execute(
            sa.text(
                "UPDATE background_tasks SET dispatched_at = clock_timestamp() "
                "WHERE id = :id AND run = :run RETURNING dispatched_at"
            ),
            {"id": task_id, "run": run},
        ).scalar_one()
    resend_stamped(app, task_id, run, stamp, kind)
    return stamp


def resend_stamped(
    app: Celery, task_id: uuid.UUID, run: int, stamp: datetime, kind: str = "EXPORT"
) -> None:
    """Send the message of the publish stamped ``stamp`` once more (a redelivery)."""
    publish_batch(app, [RunRef(task_id, run, kind, stamp=stamp)])


def broker_holds(client: redis.Redis, prefix: str, task_id: uuid.UUID, run: int) -> bool:
    """The broker holds a message for this run (waiting, or delivered and unacknowledged)."""
    return f"{task_id}-{run}" in held_ids(client, prefix)
