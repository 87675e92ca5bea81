"""Worker heartbeats in Redis (docs/design.md, "Heartbeats"; why an epoch, a drain renewal
that adds, and tombstones: docs/decisions.md, "Workers"): the protocol between the workers,
who write it (worker/liveness.py), and the dispatcher, the API and the health checks, who
read it. It lives below all of them, so none needs to import another.

Only Redis's clock is used, so hosts with skewed clocks agree. Every change is one Lua
script, atomic in Redis: a late renewal runs either before the removal (undone by it) or
after it (refused by the tombstone). Every key carries a TTL of at least 2 x ttl, so an
abandoned one disappears on its own.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import NoScriptError, ResponseError

from teamdesk import hooks

# A tombstone outlives any renewal that could still be in flight when the process stopped.
TOMBSTONE_MIN_S = 60.0
EPOCH_TAG = "~epoch/"  # the holders set's epoch member: ~epoch/<run_id>/<since>

_REDIS_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local now_text = string.format('%.6f', now)
"""

# This server's run_id (a new one at every start; a replica has its own). pcall: where
# INFO is not allowed, every server looks the same and only the other guards remain.
_SERVER = f"""
local ok, info = pcall(redis.call, 'INFO', 'server')
local server = ok and string.match(info, 'run_id:(%w+)') or 'unknown'
local epoch_tag = '{EPOCH_TAG}'
local epoch_head = epoch_tag .. server .. '/'
"""

# Holder: be a live holder until now + ttl, extend the set's key, keep its epoch.
# Needs: now, now_text, server, epoch_head; holders (key), member, ttl (s).
_HOLD = """
local function hold(holders, member, ttl)
  local keep_ms = string.format('%d', math.ceil(ttl * 2000))
  redis.call('ZREMRANGEBYSCORE', holders, '-inf', now_text)
  redis.call('ZADD', holders, string.format('%.6f', now + ttl), member)
  local current = false
  for _, seen in ipairs(redis.call('ZRANGEBYSCORE', holders, '+inf', '+inf')) do
    if string.sub(seen, 1, #epoch_head) == epoch_head then
      current = true
    else
      redis.call('ZREM', holders, seen)
    end
  end
  if not current then
    redis.call('ZADD', holders, '+inf', epoch_head .. now_text)
  end
  redis.call('PEXPIRE', holders, keep_ms)
  return keep_ms
end
"""

# KEYS: global set, scope set, tombstone, info, holders. ARGV: member, ttl (s), info (JSON:
# the queues the process consumes and its pool size; the dispatcher sizes each queue's
# window from them). Returns 1, or 0 if stopped.
_RENEW = (
    _REDIS_NOW
    + _SERVER
    + _HOLD
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then
  return 0
end
local ttl = tonumber(ARGV[2])
local keep_ms = hold(KEYS[5], ARGV[1], ttl)
for i = 1, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_text)
  redis.call('ZADD', KEYS[i], string.format('%.6f', now + ttl), ARGV[1])
  redis.call('PEXPIRE', KEYS[i], keep_ms)
end
redis.call('SET', KEYS[4], ARGV[3], 'PX', keep_ms)
return 1
"""
)

# Start or renew a drain. KEYS: global set, scope set, tombstone, info, holders. ARGV:
# member, tombstone TTL (ms), ttl (s). Leaves the active sets, stays a holder. Returns 1,
# or 0 once the drain ended.
_DRAIN = (
    _REDIS_NOW
    + _SERVER
    + _HOLD
    + """
if redis.call('GET', KEYS[3]) == 'done' then
  return 0
end
redis.call('SET', KEYS[3], 'draining', 'PX', ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[4])
hold(KEYS[5], ARGV[1], tonumber(ARGV[3]))
return 1
"""
)

# Stop for good. KEYS: global set, scope set, tombstone, info, holders. ARGV: member,
# tombstone TTL (ms).
_REMOVE = """
redis.call('SET', KEYS[3], 'done', 'PX', ARGV[2])
for i = 1, 2 do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[4])
return 1
"""

# KEYS: one set. Returns how many members are live after dropping the expired ones.
_DROP_EXPIRED_AND_COUNT = (
    _REDIS_NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_text)
return redis.call('ZCARD', KEYS[1])
"""
)

# KEYS: one set. Returns how many members are live; writes nothing.
_LIVE_COUNT = _REDIS_NOW + "return redis.call('ZCOUNT', KEYS[1], '(' .. now_text, '+inf')"

# KEYS: one set. Returns the live members; writes nothing.
_LIVE_MEMBERS = _REDIS_NOW + "return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_text, '+inf')"

# KEYS: holders, global active set. Returns {age of this server's epoch in s, or '' if
# there is none; then the live members of both}; writes nothing. Every active member is a
# holder too; reading the active set as well keeps a worker that predates the holders set
# (a rolling upgrade) from being taken for dead.
_LEASE_HOLDERS = (
    _REDIS_NOW
    + _SERVER
    + """
local found = {''}
for _, key in ipairs(KEYS) do
  for _, seen in ipairs(redis.call('ZRANGEBYSCORE', key, '(' .. now_text, '+inf')) do
    if string.sub(seen, 1, #epoch_head) == epoch_head then
      found[1] = string.format('%.6f', now - tonumber(string.sub(seen, #epoch_head + 1)))
    elseif string.sub(seen, 1, #epoch_tag) ~= epoch_tag then
      table.insert(found, seen)
    end
  end
end
return found
"""
)


def active_key(prefix: str, scope: str | None = None) -> str:
    """The set of every live process, or of one scope's processes."""
    base = f"{prefix}:worker-heartbeat:active"
    return base if scope is None else f"{base}:{scope}"


def holders_key(prefix: str) -> str:
    """Processes whose leases are alive (active or draining), plus the record's epoch."""
    return f"{prefix}:worker-heartbeat:holders"


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


@dataclass(frozen=True)
class LeaseHolders:
    """The live lease holders, and how long the record they were read from has been kept
    unbroken (None: it has no epoch from this server - emptied, restarted, failed over)."""

    members: frozenset[str]
    record_age_s: float | None


class Heartbeat:
    """This process's heartbeat member. Give ``client`` short socket timeouts: a renewal
    that waits on Redis delays the next one. Thread-safe: a worker renews on a thread of
    its own and removes the member from its main thread."""

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
            holders_key(prefix),
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

    def remove(self, draining: bool = False) -> bool:
        """Stop renewing and remove this process's member from the active sets; with
        ``draining`` it stays a lease holder (see :meth:`renew_draining`), else it goes
        from the holders too. False: the drain had ended already."""
        self._stopping.set()
        if draining:
            return self.renew_draining()
        return self._script(_REMOVE, self._tombstone_ms()) == 1

    def renew_draining(self) -> bool:
        """Start or extend the drain: out of the active sets, a holder until now + ttl
        (added, not only extended); False once :meth:`finish` ended the drain."""
        self._stopping.set()
        return self._script(_DRAIN, self._tombstone_ms(), repr(float(self.ttl_s))) == 1

    def finish(self) -> None:
        """The drain ended: nothing of this process is alive any more, and a drain renewal
        still on its way is refused."""
        self._script(_REMOVE, self._tombstone_ms())

    def _run_renewal(self) -> bool:
        """The renewal script alone, without the ``stopping`` check (tests replay a late one)."""
        return self._script(_RENEW, repr(float(self.ttl_s)), self.consumes.as_json()) == 1

    def _script(self, source: str, *args: str | int) -> int:
        script = self.client.register_script(source)
        return int(script(keys=self._keys, args=[self.member, *args]))

    def _tombstone_ms(self) -> int:
        return round(max(2 * self.ttl_s, TOMBSTONE_MIN_S) * 1000)


def read_only(client: redis.Redis, source: str, keys: list[str]) -> Any:
    """Run a script that writes nothing as ``EVALSHA_RO`` (Redis 7): a client allowed only
    to read its keys (``%R~`` in its ACL user, teamdesk/redis_acl.py: the API, the
    dispatcher) may run it, where ``EVALSHA`` counts every key it is given as written.
    Before Redis 7 (no such command) it runs as ``EVALSHA``."""
    script = client.register_script(source)
    try:
        try:
            return client.evalsha_ro(script.sha, len(keys), *keys)
        except NoScriptError:
            client.script_load(source)
            return client.evalsha_ro(script.sha, len(keys), *keys)
    except ResponseError as exc:
        if not str(exc).lower().startswith("unknown command"):
            raise
        return script(keys=keys)


def has_heartbeat(client: redis.Redis, prefix: str, scope: str | None = None) -> bool:
    """Drop expired members (by Redis time), then tell whether one is left."""
    script = client.register_script(_DROP_EXPIRED_AND_COUNT)
    return int(script(keys=[active_key(prefix, scope)])) > 0


def live_count(client: redis.Redis, prefix: str, scope: str | None = None) -> int:
    """How many active members are live by Redis time (read-only, for readers such as the
    API whose Redis user may not write the heartbeats)."""
    return int(read_only(client, _LIVE_COUNT, [active_key(prefix, scope)]))


def live_members(client: redis.Redis, prefix: str, scope: str | None = None) -> set[str]:
    """Active members whose score is later than Redis time (read-only)."""
    return {_text(m) for m in read_only(client, _LIVE_MEMBERS, [active_key(prefix, scope)])}


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


def read_lease_holders(client: redis.Redis, prefix: str) -> LeaseHolders:
    """The live holders and the record's age, in one read-only script (one instant)."""
    keys = [holders_key(prefix), active_key(prefix)]
    age, *members = [_text(m) for m in read_only(client, _LEASE_HOLDERS, keys)]
    return LeaseHolders(frozenset(members), float(age) if age else None)


def lease_holders_alive(client: redis.Redis, prefix: str) -> set[str]:
    """Members whose leases are alive: active ones and draining ones (read-only)."""
    return set(read_lease_holders(client, prefix).members)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
