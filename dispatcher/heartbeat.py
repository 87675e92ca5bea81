"""Worker heartbeats in Redis (docs/design.md, "Heartbeats").

Every process that can take work keeps one member ``<scope>/<uuid4>`` in two sorted
sets, ``<prefix>:worker-heartbeat:active`` (all processes) and
``<prefix>:worker-heartbeat:active:<scope>`` (one scope, ``WORKER_INSTANCE_ID``). A
member's score is Redis ``TIME`` + ``HEARTBEAT_TTL_S``: it is live while its score is
later than Redis's clock. Only Redis's clock is used, so hosts with skewed clocks agree.

Renewal is one Lua script: read ``TIME``, drop expired members from both sets, add the
member to both, set both keys' TTL to 2 x ttl (an abandoned set disappears on its own).

Why a tombstone: shutdown removes the member, but a renewal may already be on its way
to Redis when the stop begins (sent from the worker's timer a moment before, or delayed
in a socket buffer). If that renewal ran after the removal it would put the member
back, and the stopped process would look alive for one more TTL, so the dispatcher
would wait that long before taking its runs back. A Python flag alone cannot stop a
command that has already left the process. So :meth:`Heartbeat.remove` first sets
``<prefix>:worker-heartbeat:stopped:<member>`` (TTL at least 2 x ttl) and removes the
member in the same script, and the renewal script refuses to add a member whose
tombstone exists. Both scripts are atomic in Redis, so a renewal runs either before the
removal (and is undone by it) or after it (and is refused). The ``stopping`` flag keeps
this process from sending new renewals at all.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from teamdesk import hooks

# A tombstone outlives any renewal that could still be in flight when the process stopped.
TOMBSTONE_MIN_S = 60.0

_REDIS_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local now_text = string.format('%.6f', now)
"""

# KEYS: global set, scope set, tombstone, info. ARGV: member, ttl (s), info (JSON: the
# queues the process consumes and its pool size; the dispatcher sizes each queue's window
# from them). Returns 1, or 0 if stopped.
_RENEW = (
    _REDIS_NOW
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 0
end
local ttl = tonumber(ARGV[2])
local score = string.format('%.6f', now + ttl)
local keep_ms = string.format('%d', math.ceil(ttl * 2000))
for i = 1, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_text)
  redis.call('ZADD', KEYS[i], score, ARGV[1])
  redis.call('PEXPIRE', KEYS[i], keep_ms)
end
redis.call('SET', KEYS[4], ARGV[3], 'PX', keep_ms)
return 1
"""
)

# KEYS: global set, scope set, tombstone, info, draining set. ARGV: member, tombstone TTL
# (ms), ttl (s), "1" to keep the member as draining.
_REMOVE = (
    _REDIS_NOW
    + """
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[4])
if ARGV[4] == '1' then
  local ttl = tonumber(ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now_text)
  redis.call('ZADD', KEYS[5], string.format('%.6f', now + ttl), ARGV[1])
  redis.call('PEXPIRE', KEYS[5], string.format('%d', math.ceil(ttl * 2000)))
end
return 1
"""
)

# KEYS: draining set. ARGV: member, ttl (s). Extends a draining member (never adds one).
_RENEW_DRAINING = (
    _REDIS_NOW
    + """
local ttl = tonumber(ARGV[2])
return redis.call('ZADD', KEYS[1], 'XX', 'CH', string.format('%.6f', now + ttl), ARGV[1])
"""
)

# KEYS: one set. Returns how many members are live after dropping the expired ones.
_DROP_EXPIRED_AND_COUNT = (
    _REDIS_NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_text)
return redis.call('ZCARD', KEYS[1])
"""
)

# KEYS: one set. Returns the live members; writes nothing.
_LIVE_MEMBERS = _REDIS_NOW + "return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_text, '+inf')"


def active_key(prefix: str, scope: str | None = None) -> str:
    """The set of every live process, or of one scope's processes."""
    base = f"{prefix}:worker-heartbeat:active"
    return base if scope is None else f"{base}:{scope}"


def draining_key(prefix: str) -> str:
    """Processes that stopped taking work but still finish what they hold: their leases
    are alive, so the dispatcher must not take those runs back (they are not "active")."""
    return f"{prefix}:worker-heartbeat:draining"


def info_key(prefix: str, member: str) -> str:
    """What a live process consumes: ``{"queues": [...], "concurrency": n}`` (JSON)."""
    return f"{prefix}:worker-heartbeat:info:{member}"


def tombstone_key(prefix: str, member: str) -> str:
    """Set when ``member`` stopped; the renewal script refuses to re-add it."""
    return f"{prefix}:worker-heartbeat:stopped:{member}"


@dataclass(frozen=True)
class WorkerSlots:
    """What one worker process offers: the queues it consumes and its pool size."""

    queues: tuple[str, ...]
    concurrency: int

    def as_json(self) -> str:
        return json.dumps({"queues": list(self.queues), "concurrency": self.concurrency})

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> WorkerSlots | None:
        """None for a missing or unreadable entry (never raises)."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(tuple(str(q) for q in data["queues"]), int(data["concurrency"]))
        except (ValueError, KeyError, TypeError):
            return None


class Heartbeat:
    """This process's heartbeat member. Give ``client`` short socket timeouts: renewal
    runs on the worker's timer and must not block it."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        scope: str,
        ttl_s: float,
        consumes: WorkerSlots | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.scope = scope
        self.ttl_s = ttl_s
        self.member = f"{scope}/{uuid.uuid4()}"
        self.consumes = consumes or WorkerSlots((), 0)
        self._stopping = threading.Event()
        self._keys = [
            active_key(prefix),
            active_key(prefix, scope),
            tombstone_key(prefix, self.member),
            info_key(prefix, self.member),
        ]

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def renew(self) -> bool:
        """Register or extend the member; False once :meth:`remove` was called."""
        if self._stopping.is_set():
            return False
        hooks.fire("heartbeat.before_renewal", member=self.member)
        return self._run_renewal()

    def renew_if_healthy(self, ping_db: Callable[[], None]) -> bool:
        """Renew only after ``ping_db`` proved PostgreSQL answers (it raises otherwise).

        The renewal itself is the Redis round trip, so success proves Redis too. Errors
        from either propagate for the caller to log; the member then simply expires.
        """
        if self._stopping.is_set():
            return False
        ping_db()
        return self.renew()

    def remove(self, draining: bool = False) -> None:
        """Stop renewing and remove this process's member (only its own) from both active
        sets; with ``draining``, keep it in the draining set while in-flight work ends."""
        self._stopping.set()
        tombstone_ms = round(max(2 * self.ttl_s, TOMBSTONE_MIN_S) * 1000)
        script = self.client.register_script(_REMOVE)
        script(
            keys=[*self._keys, draining_key(self.prefix)],
            args=[self.member, tombstone_ms, repr(float(self.ttl_s)), "1" if draining else "0"],
        )

    def renew_draining(self) -> None:
        """Extend the draining member; a process that froze while draining still expires."""
        script = self.client.register_script(_RENEW_DRAINING)
        script(keys=[draining_key(self.prefix)], args=[self.member, repr(float(self.ttl_s))])

    def finish(self) -> None:
        """The drain ended: drop the draining member too."""
        self.client.zrem(draining_key(self.prefix), self.member)

    def _run_renewal(self) -> bool:
        """The renewal script alone, without the ``stopping`` check (tests replay a late one)."""
        script = self.client.register_script(_RENEW)
        args = [self.member, repr(float(self.ttl_s)), self.consumes.as_json()]
        return int(script(keys=self._keys, args=args)) == 1


def has_heartbeat(client: redis.Redis, prefix: str, scope: str | None = None) -> bool:
    """Drop expired members (by Redis time), then tell whether one is left."""
    script = client.register_script(_DROP_EXPIRED_AND_COUNT)
    return int(script(keys=[active_key(prefix, scope)])) > 0


def live_members(client: redis.Redis, prefix: str, scope: str | None = None) -> set[str]:
    """Active members whose score is later than Redis time (read-only)."""
    script = client.register_script(_LIVE_MEMBERS)
    members = script(keys=[active_key(prefix, scope)])
    return {m.decode() if isinstance(m, bytes) else str(m) for m in members}


def slots_by_queue(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Pool processes of the live (not draining) workers, per queue they consume."""
    members = sorted(live_members(client, prefix))
    if not members:
        return {}
    slots: dict[str, int] = {}
    for raw in client.mget([info_key(prefix, m) for m in members]):
        offer = WorkerSlots.from_json(raw)
        if offer is None:
            continue
        for queue in offer.queues:
            slots[queue] = slots.get(queue, 0) + offer.concurrency
    return slots


def lease_holders_alive(client: redis.Redis, prefix: str) -> set[str]:
    """Members whose leases are alive: active ones and draining ones (read-only)."""
    script = client.register_script(_LIVE_MEMBERS)
    members = [*script(keys=[active_key(prefix)]), *script(keys=[draining_key(prefix)])]
    return {m.decode() if isinstance(m, bytes) else str(m) for m in members}


def redis_uptime_s(client: redis.Redis) -> float:
    """Seconds since the Redis server started; heartbeats are trusted only past one TTL."""
    info = client.info("server")
    return float(info["uptime_in_seconds"])
