"""The Redis broker transport (tasks/broker_transport.py): closing a channel after the
transport lost its client - what Celery's consumer does when Redis went away - is a
connection error that Celery ignores, never the ``AttributeError`` that made a worker exit
("Unrecoverable error", seen in the soak's Redis restarts). Real Redis, real kombu."""

from __future__ import annotations

from collections.abc import Callable

import redis
from celery import Celery
from kombu import Exchange, Queue
from kombu.common import ignore_errors

from tasks.broker_transport import Transport
from teamdesk.config import Settings


def test_the_app_uses_the_fixed_transport_and_still_names_it_redis(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
        assert conn.as_uri().startswith("redis://")


def test_closing_a_channel_whose_connection_is_gone_keeps_its_unacked_message(
    make_app: Callable[..., Celery], settings: Settings, redis_client: redis.Redis
) -> None:
    app = make_app()
    prefix = f"{settings.queue_prefix}:"
    queue = Queue(f"{settings.queue_prefix}-transport", Exchange("", type="direct"))
    with app.connection_for_write() as conn:
        channel = conn.channel()
        bound = queue(channel)
        bound.declare()
        conn.Producer(channel).publish({"n": 1}, routing_key=queue.name, declare=[queue])
        message = bound.get(no_ack=False)
        assert message is not None and message.payload == {"n": 1}
        transport = conn.transport
        client, transport.client = transport.client, None  # the state Redis's loss leaves
        try:
            ignore_errors(conn, channel.close)  # raised AttributeError before the fix
        finally:
            transport.client = client
    unacked = redis_client.hgetall(f"{prefix}unacked")
    assert list(unacked) == [message.delivery_tag]
    redis_client.delete(f"{prefix}unacked", f"{prefix}unacked_index", queue.name)
