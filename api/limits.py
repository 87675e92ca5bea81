"""Rate limits as GCRA token buckets in Redis, shared by every API replica: failing open
when Redis is unreachable, closed when it refuses a permission (docs/design.md, "HTTP API").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import redis
from fastapi import HTTPException
from redis.exceptions import NoPermissionError

PAUSE_AFTER_FAILURE_S = 5.0  # host clock: a local timeout, never compared across hosts
US_PER_S = 1_000_000
US_PER_MIN = 60 * US_PER_S
# api/errors.py's MSG_UNAVAILABLE, which cannot be imported (it imports this module).
MSG_UNAVAILABLE = "the service is temporarily unavailable; try again shortly"
RETRY_AFTER_DENIED_S = 5
# Redis 7.0 reports a command a script may not run as a plain error; 7.2 and later as NOPERM.
SCRIPT_DENIED = "can't run this command"

logger = logging.getLogger(__name__)

# KEYS[1]: the bucket. ARGV: microseconds per token, burst (tokens), 1 to take one or
# 0 to only look. Returns 0 when a token is (or was) available, else the microseconds
# until one is. The stored value is when the bucket will be full again (GCRA).
BUCKET_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local full_at = tonumber(redis.call('GET', KEYS[1]))
if full_at == nil or full_at < now then full_at = now end
local after = full_at + interval
local wait = after - burst * interval - now
if wait > 0 then return math.ceil(wait) end
if ARGV[3] == '1' then
    redis.call('SET', KEYS[1], string.format('%.0f', after),
               'PX', math.ceil((after - now) / 1000))
end
return 0
"""


@dataclass(frozen=True)
class Rule:
    """``per_min`` requests a minute, refilled continuously, ``burst`` at once; 0: off."""

    name: str
    per_min: int
    burst: int

    @property
    def enabled(self) -> bool:
        return self.per_min > 0

    @property
    def interval_us(self) -> int:
        return max(1, US_PER_MIN // self.per_min)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: int = 0  # whole seconds (the Retry-After header), at least 1 if refused


ALLOWED = Verdict(True)


class RateLimiter:
    """Token buckets under ``<prefix>:ratelimit:<rule>:<subject>`` on the client that
    ``client()`` returns (opened lazily, so building the app needs no Redis)."""

    def __init__(
        self,
        client: Callable[[], redis.Redis],
        prefix: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._paused_until = 0.0
        self._lock = threading.Lock()
        self._denied: set[str] = set()  # the permissions Redis refused, each logged once

    def take(self, rule: Rule, subject: str) -> Verdict:
        """Take one token from ``subject``'s bucket, or say how long until one is there."""
        if not rule.enabled or self._clock() < self._paused_until:
            return ALLOWED
        try:
            client = self._client()
            script = client.register_script(BUCKET_LUA)
            args = [rule.interval_us, rule.burst, 1]
            wait_us = int(script(keys=[self.key(rule, subject)], args=args))
        except redis.RedisError as exc:
            if isinstance(exc, NoPermissionError) or SCRIPT_DENIED in str(exc):
                self._refuse(exc)
            self._pause(exc)
            return ALLOWED
        if wait_us <= 0:
            return ALLOWED
        return Verdict(False, max(1, math.ceil(wait_us / US_PER_S)))

    def key(self, rule: Rule, subject: str) -> str:
        return f"{self._prefix}:ratelimit:{rule.name}:{subject}"

    def _refuse(self, exc: redis.RedisError) -> NoReturn:
        """Fail closed: 503, and name the missing permission once (Redis's text names the
        user and command, or says "a key"; never a key's name)."""
        permission = str(exc)
        with self._lock:
            first = permission not in self._denied
            self._denied.add(permission)
        if first:
            logger.error(
                "rate limits failed closed: the API's Redis user lacks a permission",
                extra={"error": type(exc).__name__, "permission": permission},
            )
        headers = {"Retry-After": str(RETRY_AFTER_DENIED_S)}
        raise HTTPException(503, MSG_UNAVAILABLE, headers=headers) from exc

    def _pause(self, exc: Exception) -> None:
        """Fail open: stop asking Redis for a while, and say so once per pause."""
        with self._lock:
            now = self._clock()
            if now < self._paused_until:
                return
            self._paused_until = now + PAUSE_AFTER_FAILURE_S
        logger.warning(
            "rate limits not applied: Redis unavailable",
            extra={"error": type(exc).__name__, "pause_s": PAUSE_AFTER_FAILURE_S},
        )
