"""kombu's Redis and Sentinel transports, with one defect fixed (docs/design.md, "Dispatch").

Closing a channel whose transport already dropped its client (Redis restarted) read
``None.hostname`` in kombu 5.7, and the ``AttributeError`` stopped the worker (celery/kombu
#582, #970). Here it raises the connection error it is, so the consumer reconnects; the
unacked messages are restored later. ``rediss://`` keeps kombu's own transport.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

TRANSPORT_PATH = "tasks.broker_transport:Transport"
SENTINEL_TRANSPORT_PATH = "tasks.broker_transport:SentinelTransport"


def _refuse_closed(channel: kombu_redis.Channel) -> None:
    if channel.connection.client is None:
        raise redis.exceptions.ConnectionError("the broker connection is already closed")


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> Any:
        _refuse_closed(self)
        return super()._connparams(asynchronous=asynchronous)


class SentinelChannel(kombu_redis.SentinelChannel):
    def _connparams(self, asynchronous: bool = False) -> Any:
        _refuse_closed(self)
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def use_for_redis_urls() -> None:
    """Make ``redis://`` and ``sentinel://`` broker URLs use :class:`Transport` and
    :class:`SentinelTransport` (idempotent)."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT_PATH
    TRANSPORT_ALIASES["sentinel"] = SENTINEL_TRANSPORT_PATH
