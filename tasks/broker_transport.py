"""kombu's Redis transport, with one defect fixed: closing a channel whose connection is
already gone raised ``AttributeError`` instead of a connection error.

When Redis goes away (a restart, a failover), Celery's consumer closes its broker
connection and reconnects, ignoring the transport's connection errors on the way. Closing
the channel restores its unacknowledged messages, which needs a Redis client, which is
built from the connection's parameters; if the transport has already dropped its client,
kombu 5.7 reads ``None.hostname`` and the ``AttributeError`` escapes as "Unrecoverable
error": the worker exits 1 (a long-standing upstream defect, celery/kombu#582 and #970;
seen in the soak's Redis restarts). Here that state raises the connection error it is, so
the close is ignored like any other failed close and the consumer reconnects. The
unacknowledged messages stay in Redis's unacked index, where kombu restores them later;
the ledger refuses any run that was already claimed.

Registered for ``redis://`` and ``sentinel://`` URLs (kombu's ``TRANSPORT_ALIASES``, the
registry of transports by URL scheme; the sentinel transport builds its connections the
same way) by :func:`use_for_redis_urls`, which the one place that builds the Celery app
calls, so every process of the cluster uses it and URLs and logs still read as given;
``rediss://`` keeps kombu's own.
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
