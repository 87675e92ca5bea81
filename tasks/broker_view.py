"""What the broker holds of a queue, read from the broker itself: how the scan finds a
lost message (docs/design.md, "Dispatch", step 2). RabbitMQ gives only a ready count, but
with prefetch 1 and late acknowledgement a delivered message is claimed within
milliseconds, so a queue seen empty holds none of the runs still waiting.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import redis
from amqp.exceptions import AMQPError, NotFound
from celery import Celery
from kombu.exceptions import KombuError

from tasks.queueing import canonical_stamp
from teamdesk.config import is_redis_url

LIST_LIMIT = 10_000  # a queue longer than this is not listed: nothing is judged missing
UNACKED_KEY = "unacked"  # kombu's default transport option unacked_key


@dataclass(frozen=True)
class QueueView:
    """One look at a queue: the messages it holds as ``(message id, stamp)`` where the
    broker can list them, else only how many are ready (``listed`` None); ``delivered``:
    those of them a consumer took and has not acknowledged."""

    ready: int
    listed: frozenset[tuple[str, str]] | None
    delivered: frozenset[tuple[str, str]] = frozenset()

    def holds(self, message_id: str, stamp: str) -> bool:
        """Does the broker hold this publish's message (or may it: a count cannot tell)?"""
        if self.listed is None:
            return self.ready > 0
        return (message_id, stamp) in self.listed

    def only_delivered(self, message_id: str, stamp: str) -> bool:
        """Is this publish's message held only as taken by a consumer? Whether that
        consumer lives, the broker cannot say: kombu keeps the message until its
        visibility timeout (an hour)."""
        return (message_id, stamp) in self.delivered


def look(
    app: Celery, client: redis.Redis | None, prefix: str, queues: Iterable[str]
) -> dict[str, QueueView | None]:
    """What each of ``queues`` holds now; None for a queue the broker cannot say about (an
    error, a list too long to read). ``client``: the broker's Redis, when the broker is
    Redis. Raises redis.RedisError."""
    if client is not None and is_redis_url(app.conf.broker_url or ""):
        return _look_redis(client, prefix, list(queues))
    return _look_amqp(app, queues)


def _look_redis(client: redis.Redis, prefix: str, queues: list[str]) -> dict[str, QueueView | None]:
    """Every queue's list and the unacknowledged messages, in one MULTI (one instant)."""
    with client.pipeline(transaction=True) as pipe:
        for queue in queues:
            pipe.llen(f"{prefix}:{queue}")
            pipe.lrange(f"{prefix}:{queue}", 0, LIST_LIMIT - 1)
        pipe.hvals(f"{prefix}:{UNACKED_KEY}")
        *lists, delivered = pipe.execute()
    held: dict[str, set[tuple[str, str] | None]] = {queue: set() for queue in queues}
    for entry in delivered:
        raw, routing_key = _unacked(entry)
        if routing_key in held:
            held[routing_key].add(_identity(raw))
    views: dict[str, QueueView | None] = {}
    for i, queue in enumerate(queues):
        length, waiting = int(lists[2 * i]), lists[2 * i + 1]
        if length > LIST_LIMIT:
            views[queue] = None
            continue
        in_list = {_identity(raw) for raw in waiting}
        taken = frozenset(h for h in held[queue] - in_list if h is not None)
        listed = frozenset(h for h in held[queue] | in_list if h is not None)
        views[queue] = QueueView(length, listed, taken)
    return views


def _look_amqp(app: Celery, queues: Iterable[str]) -> dict[str, QueueView | None]:
    """Ready counts by passive declares, one channel each (a 404 closes its channel), on
    one short connection."""
    views: dict[str, QueueView | None] = dict.fromkeys(queues)
    try:
        with app.connection_for_read() as conn:
            for queue in views:
                channel = conn.channel()
                try:
                    _name, ready, _consumers = channel.queue_declare(queue=queue, passive=True)
                    views[queue] = QueueView(int(ready), None)
                except NotFound:  # never declared (or deleted): it holds nothing
                    views[queue] = QueueView(0, None)
                finally:
                    with suppress(AMQPError, KombuError, OSError):
                        channel.close()
    except (AMQPError, KombuError, OSError):
        pass  # the queues not read yet stay None: cannot tell
    return views


def _unacked(entry: bytes) -> tuple[Any, str | None]:
    """kombu's unacked entry: ``[message, exchange, routing key]`` (JSON)."""
    try:
        message, _exchange, routing_key = json.loads(entry)
    except (ValueError, TypeError):
        return None, None
    return message, routing_key


def _identity(raw: Any) -> tuple[str, str] | None:
    """``(message id, stamp)`` of one of the dispatcher's messages, else None."""
    try:
        message = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        message_id = message["headers"]["id"]
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        stamp = args[2] if len(args) > 2 else ""
    except (ValueError, KeyError, TypeError, IndexError, binascii.Error):
        return None
    return str(message_id), canonical_stamp(str(stamp))  # compared as a timestamp
