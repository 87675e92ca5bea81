"""Faults of the platform's services: the soak's own Redis (a Sentinel group,
soak/sentinel.py: every Redis fault acts on its current master) and its own PostgreSQL.

- ``pgkill``: ``pg_terminate_backend`` on the workers' connections (``application_name =
  'teamdesk-tasks'``; the soak's own are ``teamdesk-soak``), 1-4 rounds 0.25 s apart, each
  either the connections running a statement or a random share of them all.
- ``pgrestart``: ``pg_ctl stop -m fast`` (70 %) or ``-m immediate`` (30 %: no checkpoint,
  crash recovery at the start, asynchronous commits lost), down 0-2 s, ``pg_ctl start``.
  Every connection of every process is cut; the soak's own work waits (soak/gate.py).
- ``pgsqueeze``: the soak opens connections (as the superuser, like everyone) until the
  server refuses one ("too many clients"), holds them ``2 x HEARTBEAT_TTL_S`` + 1-3 s,
  taking every slot that frees meanwhile, then closes them all. Connections already open
  keep working; every new one is refused. No slot is left for anyone: one left free goes
  to whoever asks first (a worker's liveness check asks every 0.75 s), and the squeeze
  would leak. The soak's own transactions wait at the gate instead, as for a restart; its
  readers outside the gate look again when refused.
- ``redis``: SIGTERM or SIGKILL the master, down 0-2 s, start it again on its port (empty;
  its replica resyncs and is emptied too). Shorter than the sentinels' down-after
  (soak/options.py): a reboot to them, not a failover.
- ``flush``: ``FLUSHALL``: the same loss without the disconnection (clients keep their
  connections, and what they cached about the server, such as declared queues).
- ``squeeze``: ``maxmemory`` = ``used_memory`` + ``SQUEEZE_HEADROOM_BYTES`` with the
  ``volatile-lru`` policy for 2-5 s: keys with a TTL (results, the leader lock,
  heartbeat keys if they have one) are evicted, and once none is left, writes are
  refused (OOM). Then ``maxmemory 0`` and the previous policy.
- ``failover``: SIGKILL the master; the sentinels promote the replica (what the master had
  not replicated is lost); the old master's port starts again as the new master's replica
  and the fault ends once it is in sync and every sentinel sees it (the group is whole for
  the next one).

Redis faults never overlap (one lock); neither do PostgreSQL faults.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg2
import redis
import sqlalchemy as sa

from soak.chaos import Chaos, Record
from soak.postgres import MAX_CONNECTIONS

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
# pgsqueeze: what the server says when it has no slot left (the second for a role without
# superuser; the soak's processes all connect as the superuser).
REFUSED = ("too many clients", "remaining connection slots are reserved")
SQUEEZE_APPLICATION = "teamdesk-soak-squeeze"
SQUEEZE_TOP_UP_S = 0.2  # how often a held squeeze takes the slots that freed
CLIENT_BACKENDS = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
)


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


def pgsqueeze(chaos: Chaos, record: Record) -> None:
    ttl = chaos.timings.heartbeat_ttl_s
    hold_s = round(record.rng.uniform(2 * ttl + 1.0, 2 * ttl + 3.0), 1)
    record.detail = f"every free connection held {hold_s}s"
    _one_at_a_time(chaos, chaos.pg_lock, record, _pg_squeeze, hold_s)


def _pg_squeeze(chaos: Chaos, record: Record, hold_s: float) -> None:
    held: list[Any] = []
    with chaos.gate.exclusive() as drained:
        if not drained:
            record.detail = "skipped: the soak's own transactions did not end"
            return
        try:
            _squeeze_connections(chaos, record, held, hold_s)
        finally:
            for conn in held:
                conn.close()
    time.sleep(PG_SETTLE_S)  # the next database fault finds the workers connected again


def _squeeze_connections(chaos: Chaos, record: Record, held: list[Any], hold_s: float) -> None:
    """Fill ``held`` until the server refuses, then keep it full for ``hold_s``."""
    filling = time.monotonic()
    refusal = _take_free_slots(chaos, held)
    filled_s = time.monotonic() - filling
    if refusal is None or not held:
        record.detail = f"skipped: {record.detail}: the server did not refuse a connection"
        return
    others = _other_clients(held[0], len(held))
    start = chaos.timeline.now()
    taken, deadline = len(held), time.monotonic() + hold_s
    while time.monotonic() < deadline:
        time.sleep(SQUEEZE_TOP_UP_S)
        _take_free_slots(chaos, held)
    chaos.timeline.event("pgsqueeze", start, f"{len(held)} connections held")
    record.detail += (
        f": took {taken} connections in {filled_s:.1f}s ({others} others open), "
        f"{len(held) - taken} more freed during the hold; refused {refusal!r}"
    )


def _take_free_slots(chaos: Chaos, held: list[Any]) -> str | None:
    """Open connections into ``held`` until the server refuses one: its message, or None
    when it failed otherwise (unreachable) or never refused."""
    while len(held) < MAX_CONNECTIONS:
        try:
            held.append(
                psycopg2.connect(
                    chaos.postgres.admin_url,
                    connect_timeout=2,
                    application_name=SQUEEZE_APPLICATION,
                )
            )
        except psycopg2.OperationalError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            return message if any(r in message for r in REFUSED) else None
    return None


def _other_clients(conn: Any, held: int) -> int:
    """Client connections open besides the squeeze's own (the cluster's and the soak's)."""
    with conn.cursor() as cur:
        cur.execute(str(CLIENT_BACKENDS))
        (total,) = cur.fetchone()
    conn.rollback()
    return int(total) - held


# ---- Redis --------------------------------------------------------------------------------
def _client(chaos: Chaos) -> redis.Redis:
    """A client of the current master (through the sentinels); answers are bytes."""
    return chaos.redis_server.client(REDIS_TIMEOUT_S)


def _unrecovered(chaos: Chaos, record: Record, exc: Exception) -> None:
    record.detail += f"; NOT RECOVERED: {exc}"
    chaos.unrecovered.append(f"{record.kind} at {record.at_s:.1f}s: {exc}")


def redis_restart(chaos: Chaos, record: Record) -> None:
    sig = signal.SIGKILL if record.rng.random() < 0.5 else signal.SIGTERM
    down_s = round(record.rng.uniform(0.0, 2.0), 1)
    record.detail = f"{sig.name}, down {down_s}s"
    _one_at_a_time(chaos, chaos.redis_lock, record, _redis_restart, sig, down_s)


def _redis_restart(chaos: Chaos, record: Record, sig: signal.Signals, down_s: float) -> None:
    group = chaos.redis_server
    port = group.master_port
    start = chaos.timeline.now()
    try:
        failed_over = group.restart_master(sig, down_s)
    except RuntimeError as exc:
        _unrecovered(chaos, record, exc)
        return
    chaos.timeline.event("redis", start, f"restart of the master :{port}")
    record.detail += f", master :{port}, whole again after {chaos.timeline.now() - start:.1f}s"
    if failed_over:
        record.detail += f" (the sentinels failed over meanwhile: :{group.master_port} master)"


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
        policy = _text(client.config_get("maxmemory-policy"), "maxmemory-policy")
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


def _text(answer: Any, key: str) -> str:
    """``key``'s value in a CONFIG GET answer (bytes or str)."""
    pairs = {_decode(k): _decode(v) for k, v in dict(answer).items()}
    return pairs[key]


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def failover(chaos: Chaos, record: Record) -> None:
    record.detail = "SIGKILL of the master"
    _one_at_a_time(chaos, chaos.redis_lock, record, _failover)


def _failover(chaos: Chaos, record: Record) -> None:
    group = chaos.redis_server
    old = group.master_port
    start = chaos.timeline.now()
    try:
        promoted_s, rejoined_s = group.failover()
    except RuntimeError as exc:
        _unrecovered(chaos, record, exc)
        return
    chaos.timeline.event("failover", start, f":{old} killed, :{group.master_port} promoted")
    record.detail = (
        f"SIGKILL of the master :{old}, :{group.master_port} promoted after {promoted_s:.1f}s, "
        f":{old} back as its replica, in sync {rejoined_s:.1f}s later"
    )
