"""Faults of the platform's services: the soak's own Redis and its own PostgreSQL.

- ``pgkill``: ``pg_terminate_backend`` on the workers' connections (``application_name =
  'teamdesk-tasks'``; the soak's own are ``teamdesk-soak``), 1-4 rounds 0.25 s apart, each
  either the connections running a statement or a random share of them all.
- ``pgrestart``: ``pg_ctl stop -m fast`` (70 %) or ``-m immediate`` (30 %: no checkpoint,
  crash recovery at the start, asynchronous commits lost), down 0-2 s, ``pg_ctl start``.
  Every connection of every process is cut; the soak's own work waits (soak/gate.py).
- ``redis``: SIGTERM or SIGKILL the Redis, down 0-2 s, start it again (empty).
- ``flush``: ``FLUSHALL``: the same loss without the disconnection (clients keep their
  connections, and what they cached about the server, such as declared queues).
- ``squeeze``: ``maxmemory`` = ``used_memory`` + ``SQUEEZE_HEADROOM_BYTES`` with the
  ``volatile-lru`` policy for 2-5 s: keys with a TTL (queued markers, results, the
  leader lock, heartbeat keys if they have one) are evicted, and once none is left,
  writes are refused (OOM). Then ``maxmemory 0`` and the previous policy.

Redis faults never overlap (one lock); neither do PostgreSQL restarts.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import sqlalchemy as sa

from soak.chaos import Chaos, Record

WORKER_CONNECTIONS = sa.text("""
    SELECT pid, state FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'teamdesk-tasks'
       AND pid <> pg_backend_pid()
""")
TERMINATE = sa.text("SELECT pg_terminate_backend(pid) FROM unnest(CAST(:pids AS int[])) AS pid")
LOCK_WAIT_S = 45.0  # a fault of one service waits this long for the previous one to end
PG_SETTLE_S = 2.0
SQUEEZE_HEADROOM_BYTES = 64 * 1024
REDIS_TIMEOUT_S = 5.0


def _one_at_a_time(
    chaos: Chaos, lock: threading.Lock, record: Record, action: Callable[..., None], *args: Any
) -> None:
    """Run a service fault in its own thread once the previous fault of that service is
    over (the injector's schedule never waits for it)."""

    def run() -> None:
        if not lock.acquire(timeout=LOCK_WAIT_S):
            record.detail = (
                f"skipped: the previous fault of the service still runs; {record.detail}"
            )
            return
        try:
            action(chaos, record, *args)
        finally:
            lock.release()

    chaos.later(run)


# ---- PostgreSQL ---------------------------------------------------------------------------
def pgkill(chaos: Chaos, record: Record) -> None:
    """1-4 rounds 0.25 s apart; each ends either the connections running a statement
    (a claim, a progress write, a commit in flight) or a random share of them all."""
    # Drawn now, in the injector's thread, so the seed decides them (the rounds run later).
    count = record.rng.randint(1, 4)
    rounds = [(record.rng.random() < 0.5, record.rng.getrandbits(32)) for _ in range(count)]
    _one_at_a_time(chaos, chaos.pg_lock, record, _pgkill, rounds)


def _pgkill(chaos: Chaos, record: Record, rounds: list[tuple[bool, int]]) -> None:
    postponed = _postponed(chaos)
    ended = []
    start = chaos.timeline.now()
    try:
        with chaos.gate.shared():
            for n, (active_only, seed) in enumerate(rounds):
                if n:
                    time.sleep(0.25)
                ended.append(_terminate(chaos, active_only, random.Random(seed)))
    except sa.exc.DBAPIError as exc:
        record.detail = f"skipped: PostgreSQL did not answer ({type(exc.orig).__name__})"
        return
    rounds_text = ", ".join(f"{n} of {seen}" for n, seen in ended)
    record.detail = f"{len(rounds)} rounds, terminated {rounds_text} worker connections{postponed}"
    if any(n for n, _seen in ended):
        chaos.timeline.event("pgkill", start, f"{sum(n for n, _seen in ended)} connections")


def _postponed(chaos: Chaos) -> str:
    waited = chaos.unshielded()
    return f" (held back {waited:.1f}s by a long export)" if waited >= 0.1 else ""


def _terminate(chaos: Chaos, active_only: bool, rng: random.Random) -> tuple[int, int]:
    """(terminated, seen) worker connections."""
    with chaos.engine.connect() as conn:
        rows = list(conn.execute(WORKER_CONNECTIONS))
        if active_only:
            chosen = [int(r.pid) for r in rows if r.state == "active"]
        else:
            pids = [int(r.pid) for r in rows]
            chosen = rng.sample(pids, rng.randint(1, len(pids))) if pids else []
        if chosen:
            conn.execute(TERMINATE, {"pids": chosen})
        conn.commit()
    return len(chosen), len(rows)


def pgrestart(chaos: Chaos, record: Record) -> None:
    mode = "immediate" if record.rng.random() < 0.3 else "fast"
    down_s = round(record.rng.uniform(0.0, 2.0), 1)
    record.detail = f"pg_ctl stop -m {mode}, down {down_s}s, start"
    _one_at_a_time(chaos, chaos.pg_lock, record, _pg_restart, mode, down_s)


def _pg_restart(chaos: Chaos, record: Record, mode: str, down_s: float) -> None:
    record.detail += _postponed(chaos)
    with chaos.gate.exclusive() as drained:
        if not drained:
            record.detail = "skipped: the soak's own transactions did not end"
            return
        start = chaos.timeline.now()
        chaos.postgres.restart(mode, down_s)
        chaos.timeline.event("pgrestart", start, f"-m {mode}")
        record.detail += f" (back after {chaos.timeline.now() - start:.1f}s)"
    time.sleep(PG_SETTLE_S)  # the next database fault finds the workers connected again


# ---- Redis --------------------------------------------------------------------------------
def _client(chaos: Chaos) -> redis.Redis:
    return redis.Redis.from_url(
        chaos.redis_server.url, socket_timeout=REDIS_TIMEOUT_S, decode_responses=True
    )


def redis_restart(chaos: Chaos, record: Record) -> None:
    sig = signal.SIGKILL if record.rng.random() < 0.5 else signal.SIGTERM
    down_s = round(record.rng.uniform(0.0, 2.0), 1)
    record.detail = f"{sig.name}, down {down_s}s"
    _one_at_a_time(chaos, chaos.redis_lock, record, _redis_restart, sig, down_s)


def _redis_restart(chaos: Chaos, record: Record, sig: signal.Signals, down_s: float) -> None:
    start = chaos.timeline.now()
    chaos.redis_server.stop(sig)
    time.sleep(down_s)
    chaos.redis_server.start()
    chaos.timeline.event("redis", start, "restart")
    record.detail += f", restart #{chaos.redis_server.starts - 1}"


def flush(chaos: Chaos, record: Record) -> None:
    record.detail = "FLUSHALL"
    _one_at_a_time(chaos, chaos.redis_lock, record, _flush)


def _flush(chaos: Chaos, record: Record) -> None:
    client = _client(chaos)
    try:
        keys = int(client.dbsize())
        start = chaos.timeline.now()
        client.flushall()
        chaos.timeline.event("flush", start, f"{keys} keys")
        record.detail = f"FLUSHALL, {keys} keys gone"
    except redis.RedisError as exc:
        record.detail = f"skipped: Redis did not answer ({type(exc).__name__})"
    finally:
        client.close()


def squeeze(chaos: Chaos, record: Record) -> None:
    hold_s = round(record.rng.uniform(2.0, 5.0), 1)
    record.detail = (
        f"maxmemory used + {SQUEEZE_HEADROOM_BYTES // 1024} KiB, volatile-lru, {hold_s}s"
    )
    _one_at_a_time(chaos, chaos.redis_lock, record, _squeeze, hold_s)


def _squeeze(chaos: Chaos, record: Record, hold_s: float) -> None:
    client = _client(chaos)
    try:
        policy = str(client.config_get("maxmemory-policy")["maxmemory-policy"])
        evicted = int(client.info("stats")["evicted_keys"])
        used = int(client.info("memory")["used_memory"])
        start = chaos.timeline.now()
        try:
            client.config_set("maxmemory-policy", "volatile-lru")
            client.config_set("maxmemory", used + SQUEEZE_HEADROOM_BYTES)
            time.sleep(hold_s)
        finally:
            client.config_set("maxmemory", 0)
            client.config_set("maxmemory-policy", policy)
        evicted = int(client.info("stats")["evicted_keys"]) - evicted
        chaos.timeline.event("squeeze", start, f"{evicted} keys evicted")
        record.detail += f": used {used // 1024} KiB, {evicted} keys evicted"
    except redis.RedisError as exc:
        record.detail += f"; Redis error {type(exc).__name__}"
    finally:
        client.close()
