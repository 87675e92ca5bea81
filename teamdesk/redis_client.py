"""Every Redis client the cluster opens, direct or through sentinels (docs/design.md,
"Topologies"). Every call is bounded by a socket timeout; ``retries`` immediate retries
cover a pooled connection a Redis restart cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from teamdesk.config import SENTINEL_SEPARATOR, Settings, is_sentinel_url

SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelTarget:
    """A sentinel URL, read: the sentinels' addresses and the master's credentials."""

    sentinels: list[tuple[str, int]]
    db: int
    username: str | None
    password: str | None


def sentinel_target(url: str) -> SentinelTarget:
    """Read ``sentinel://[[user]:password@]host:port[/db][;sentinel://host:port...]``."""
    chunks = [urlsplit(chunk) for chunk in url.split(SENTINEL_SEPARATOR)]
    first = chunks[0]
    path = first.path.strip("/")
    return SentinelTarget(
        sentinels=[(part.hostname or "", part.port or SENTINEL_PORT) for part in chunks],
        db=int(path) if path.isdigit() else 0,
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
    )


def redis_client(settings: Settings, url: str, timeout_s: float, retries: int = 0) -> redis.Redis:
    """A client of the Redis ``url`` names (REDIS_URL or BROKER_URL of ``settings``)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), retries),
    }
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = sentinel_target(url)
    sentinel_options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if settings.redis_sentinel_password:
        sentinel_options["password"] = settings.redis_sentinel_password
    sentinel = Sentinel(target.sentinels, sentinel_kwargs=sentinel_options, **options)
    return sentinel.master_for(
        settings.redis_sentinel_master,
        db=target.db,
        username=target.username,
        password=target.password,
    )
