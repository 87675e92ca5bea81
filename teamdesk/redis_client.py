"""Every Redis client the cluster opens comes from :func:`redis_client` (whether a URL
names Redis is ``teamdesk.config.is_redis_url``).

Each client bounds every call with a socket timeout, so a frozen Redis stalls no caller
longer than the caller chose; ``retries`` immediate retries (no backoff) cover a pooled
connection that a Redis restart cut.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def redis_client(url: str, timeout_s: float, retries: int = 0) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries),
    )
