"""A worker whose database check waits in a real PgBouncer's queue keeps its heartbeat
(issue 34; docs/design.md, "Heartbeats").

Behind PgBouncer in transaction pooling a new connection succeeds at once, and its
``SELECT 1`` waits for a server connection as long as ``query_wait_timeout`` allows
whenever the pool is full; libpq's ``connect_timeout`` does not bound that wait. w1 reaches
PostgreSQL through PgBouncer (``default_pool_size=1``); the test fills the pool with one
open transaction of its own for longer than two ``HEARTBEAT_TTL_S`` while w1 holds a
claimed export (parked right after its claim, which holds no server connection) and w2,
connected directly, runs another export. Before, w1 checked the database on its renewal
thread: the check waited in the queue, no renewal came, the member left the live and
holder sets after one TTL, and the dispatcher took w1's live run back. Now the check runs
on a thread of its own: w1's member stays (every renewal lands before the last one
expires), w1 pauses intake once the check is past its bound and resumes when the pool is
free, and nothing is taken back."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psycopg2
import pytest
import redis
import sqlalchemy as sa

from dispatcher.scan import read_heartbeats
from harness.databases import through
from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate, reached_key
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from teamdesk.heartbeat import active_key, lease_holders_alive, live_members
from tests.support.pgbouncer import pgbouncer

pytestmark = pytest.mark.slow

T = TypeVar("T")

TTL_S = 2.0  # renewals and checks every 0.5 s; a check's bound 3 s
QUEUE_WAIT_S = 60  # PgBouncer's query_wait_timeout: the check hangs for the whole hold
GATE_TIMEOUT_S = "120"


class MemberWatch:
    """One member's heartbeat, read at every poll while the pool is full: in the live
    (active) set and among the lease holders (teamdesk.heartbeat), and its score in the
    active set (Redis ``TIME`` + TTL at its last renewal)."""

    def __init__(self, client: redis.Redis, prefix: str, member: str) -> None:
        self.client, self.prefix, self.member = client, prefix, member
        self.scores: list[float] = []

    def sample(self) -> None:
        live = self.member in live_members(self.client, self.prefix)
        holder = self.member in lease_holders_alive(self.client, self.prefix)
        assert (live, holder) == (True, True), f"w1's member left the sets: {live=} {holder=}"
        score = self.client.zscore(active_key(self.prefix), self.member)
        assert score is not None
        if not self.scores or score != self.scores[-1]:
            self.scores.append(score)

    def until(self, probe: Callable[[], T], what: str, timeout: float = 30.0) -> T:
        def step() -> T:
            self.sample()
            return probe()

        return wait_for(step, timeout=timeout, what=what)

    def renewed_since(self, at: float) -> bool:
        """A renewal came at ``at`` (Redis time) or later."""
        return bool(self.scores) and self.scores[-1] - TTL_S >= at

    def gaps(self) -> list[float]:
        """Between the renewals seen: each under TTL_S means each renewal landed before
        the one before it expired (renewals not seen only make the gaps shorter)."""
        return [b - a for a, b in zip(self.scores, self.scores[1:], strict=False)]


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def create_export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def gated(s: Settings, point: str, **extra: object) -> dict[str, str]:
    return settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES=point,
        TEAMDESK_TEST_GATE_TIMEOUT_S=GATE_TIMEOUT_S,
        **extra,
    )


def started(proc: Proc, task_id: uuid.UUID) -> list[str]:
    return [e["execution"] for e in proc.events("task.started") if e["task_id"] == str(task_id)]


def test_a_check_queued_in_a_full_pgbouncer_pool_never_lapses_the_heartbeat(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings.with_overrides(heartbeat_ttl_s=TTL_S, scan_interval_s=1.0, export_batch_size=2)
    prefix, direct = s.queue_prefix, s.database_url
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5)
    claimed_gate = RemoteGate(redis_client, prefix, "task.claimed")
    read_gate = RemoteGate(redis_client, prefix, "export.after_read")
    with pgbouncer(pool_size=1, query_wait_timeout_s=QUEUE_WAIT_S) as port:
        pooled_url = through(direct, port)
        w1_env = gated(
            s, "task.claimed", DATABASE_URL=pooled_url, DATABASE_PREPARED_STATEMENTS="off"
        )
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), w1_env, tmp_path).start()
            beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
            procs += [w1, beat]
            m1 = w1.wait_event("worker.started")["member"]
            wait_for(
                lambda: read_heartbeats(redis_client, prefix, s.heartbeat_ttl_s).trusted,
                what="the heartbeat record to be trusted (the dispatcher's rule in force)",
            )
            first = create_export(engine, world)
            claimed_gate.wait_reached(timeout=60)  # w1 claimed it through PgBouncer
            row = task_row(engine, first)
            assert (row["status"], row["lease_holder"]) == ("RUNNING", m1)
            w2 = Proc(
                "w2", worker_argv("w2", concurrency=1), gated(s, "export.after_read"), tmp_path
            )
            procs.append(w2.start())
            w2.wait_event("worker.started")
            watch = MemberWatch(redis_client, prefix, m1)
            watch.sample()

            # The pool's one server connection, held by an open transaction.
            hold = psycopg2.connect(pooled_url, application_name="test-pool-hold")
            try:
                hold.cursor().execute("SELECT 1")
                held_at = redis_now(redis_client)
                watch.until(
                    lambda: w1.events("worker.consuming_paused"),
                    what="w1 to pause intake, its check queued in PgBouncer",
                )
                second = create_export(engine, world)  # for w2: w1 is paused (and busy)
                watch.until(
                    lambda: redis_client.lpop(reached_key(prefix, read_gate.point)),
                    what="w2 to run the second export while the pool is full",
                )
                watch.until(
                    lambda: watch.renewed_since(held_at + 2 * TTL_S),
                    what="a renewal of w1 two TTLs into the full pool",
                )
                read_gate.release(times=3)  # two batches of two, then the last one
                watch.until(lambda: task_row(engine, second)["status"] == "COMPLETED", "w2")
                row = task_row(engine, first)  # w1's run: alive, never taken back
                assert (row["status"], row["lease_holder"], row["recoveries"]) == ("RUNNING", m1, 0)
                assert beat.events("task.stalled") == []
            finally:
                hold.rollback()  # the pool is free: w1's queued check gets the connection
                hold.close()

            watch.until(lambda: w1.events("worker.consuming_resumed"), "w1 to resume intake")
            claimed_gate.release()
            wait_for(
                lambda: task_row(engine, first)["status"] == "COMPLETED",
                what="w1 to complete its export through PgBouncer",
            )
            for proc in (w1, w2):
                proc.send(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0
    gaps = watch.gaps()
    print(f"w1: {len(gaps)} renewals seen across the full pool, the longest gap {max(gaps):.2f} s")
    assert all(gap < TTL_S for gap in gaps), gaps
    assert watch.scores[-1] - watch.scores[0] > 2 * TTL_S
    consuming = [e["event"] for e in w1.lines() if e["event"].startswith("worker.consuming")]
    assert consuming == ["worker.consuming_paused", "worker.consuming_resumed"]
    failed = [(e.get("stage"), e.get("error")) for e in w1.events("heartbeat.failed")]
    assert failed == [("database", "CheckOverdue")]
    assert w2.events("worker.consuming_paused") == []
    assert beat.events("task.stalled") == []
    assert len(started(w1, first)) == 1 and len(started(w2, second)) == 1
    for task_id in (first, second):
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
