"""PostgreSQL failover (README, "Production topologies"): with ``DATABASE_URL`` listing a
primary and its standby in libpq's form (``postgresql://u@primary,standby/db?
target_session_attrs=read-write``), the primary dying mid-run and the standby's promotion
cost the cluster one attempt of each execution the death interrupted, and nothing else:
every task completes exactly once on the promoted server, and no process exits.

Topology: a private primary (soak/postgres.py) and a hot standby streaming from it
(tests/support/pg_standby.py: ``pg_basebackup -R``), each on a port of its own; the
machine's shared PostgreSQL is never touched. The test database is created and migrated
on the primary before the copy. One real worker (``-c 2``, both queues) and a real beat
use the two-host URL for everything: the engines, the liveness check, the failure reports
and the dispatcher's LISTEN connection.

The interleaving is forced by gates, never by sleeps: the worker parks every export after
its read (``export.after_read``) and every reminder after its side effects are written,
before its completion commits (``reminder.after_event_insert``). Once some of each have
gone through, one execution is kept waiting at each gate until both pool processes are
parked, each holding a claim: an export with its CSV read, and a reminder whose
notification, version bump and event are written but not committed. The primary is then
killed (``pg_ctl stop -m immediate``) and the parked executions let go: their connections
are gone and no server takes writes (the standby refuses ``read-write`` sessions), so each
attempt fails and its failure report waits. The worker's liveness check sees the outage
(``heartbeat.failed``) before the standby is promoted. Then the two reports land on the
promoted server, the two runs retry after the backoff, and everything left runs there.

Which data the promoted server starts with: replication is asynchronous (PostgreSQL's
default), and the primary is killed only once the standby has replayed all the WAL the
primary had written while both pool processes were parked, so the promoted server holds
everything committed, the two claims' asynchronous commits included, and each run's
outcome is exact. That is deliberate: on a lagging standby a completion the primary had
acknowledged can be missing after the promotion, and its run then stays RUNNING under a
lease holder whose heartbeat is live (the worker is): only the staleness rule takes it
back, after ``STALE_AFTER_S``. That is the price of asynchronous replication
(``synchronous_standby_names`` avoids it), not something a test bounded in seconds can
show. For the same reason ``STALE_AFTER_S`` stays at its default (120 s), far beyond this
test's bounds: every run completes without the staleness rule, and the exact audit trails
below leave no room for a ``RECOVER``.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest
import redis
import sqlalchemy as sa

from dispatcher.listener import APPLICATION_NAME as LISTEN_APPLICATION
from ledger import service
from ledger.migrate import upgrade
from soak.postgres import SoakPostgres
from tasks.reminder import EVENT_TYPE
from teamdesk.config import Settings
from teamdesk.db import make_engine
from tests.support.factories import (
    add_ticket,
    add_tickets,
    audit_events,
    make_world,
    notifications,
    task_row,
)
from tests.support.pg_standby import Standby, primary_wal_lsn, streaming_standby
from tests.support.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from tests.support.remote_gates import RemoteGate, reached_key
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

EXPORTS = 40
REMINDERS = 40
LOOSE_TICKETS = 10  # unassigned tickets; every export has them and the reminders' tickets
EXPORT_ROWS = LOOSE_TICKETS + REMINDERS  # under EXPORT_BATCH_SIZE: one gate stop per attempt
FREE_PASSES = 8  # executions each gate lets through before it keeps one waiting
EXPORT_GATE = "export.after_read"
REMINDER_GATE = "reminder.after_event_insert"
GATED = {
    "TEAMDESK_TEST_HOOKS": "tests.support.remote_gates",
    "TEAMDESK_TEST_GATES": f"{EXPORT_GATE},{REMINDER_GATE}",
    "TEAMDESK_TEST_GATE_TIMEOUT_S": "600",
}
PARKED_WITHIN_S = 60.0  # detects a gate never reached
REPLAYED_WITHIN_S = 10.0  # detects a standby that stopped streaming
DONE_WITHIN_S = 45.0  # detects a run left behind (the staleness rule would take 120 s)
RETRIED = ["CLAIM", "WAIT", "CLAIM", "COMPLETE"]  # the two runs the failover interrupted
ONCE = ["CLAIM", "COMPLETE"]  # every other run


@pytest.fixture
def primary() -> Iterator[SoakPostgres]:
    workdir = Path(tempfile.mkdtemp(prefix="td-failover-"))
    postgres = SoakPostgres(workdir)
    try:
        postgres.create()
        yield postgres
    finally:
        postgres.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


def two_host_url(primary: SoakPostgres, standby: Standby, database: str) -> str:
    """libpq's list: the primary first; only a server that takes writes is accepted."""
    hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
    return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"


@dataclass(frozen=True)
class Workload:
    exports: list[uuid.UUID]
    reminders: dict[uuid.UUID, uuid.UUID]  # reminder task -> its ticket

    @property
    def tasks(self) -> list[uuid.UUID]:
        return [*self.exports, *self.reminders]


def create_workload(engine: sa.Engine) -> Workload:
    """Team exports, and reminders of OPEN tickets assigned to a staff member."""
    world = make_world(engine)
    team, staff, customer = world.team_id, world.staff_id, world.customer_id
    with engine.begin() as conn:
        add_tickets(conn, team, customer, LOOSE_TICKETS)
        reminders = {}
        for n in range(REMINDERS):
            ticket = add_ticket(conn, team, customer, f"Call {n}", assignee_id=world.staff2_id)
            reminders[service.create_reminder(conn, team, staff, ticket)] = ticket
        exports = [service.create_export(conn, team, staff, "TEAM", {}) for _ in range(EXPORTS)]
    return Workload(exports, reminders)


class Keeper:
    """One gate's policy: the first ``free`` executions go through, then one is kept
    waiting and every later arrival goes on. Release tokens are anonymous, so which
    execution waits is read from the ledger, not from the arrivals."""

    def __init__(self, client: redis.Redis, prefix: str, point: str, free: int) -> None:
        self.gate = RemoteGate(client, prefix, point)
        self.reached = reached_key(prefix, point)
        self.arrived, self.released = 0, free
        self.gate.release(times=free)

    def holds_one(self) -> bool:
        """Count the new arrivals, let all but one through; whether one is kept waiting."""
        while self.gate.client.lpop(self.reached) is not None:
            self.arrived += 1
        if self.arrived - self.released > 1:
            self.gate.release(times=self.arrived - self.released - 1)
            self.released = self.arrived - 1
        return self.arrived - self.released == 1

    def open(self, times: int) -> None:
        self.gate.release(times=times)


def park_both(keepers: list[Keeper]) -> None:
    """Until each gate keeps one execution waiting: with two pool processes and every
    release token taken, both processes are parked and nothing else runs."""
    wait_for(
        lambda: all([keeper.holds_one() for keeper in keepers]),
        timeout=PARKED_WITHIN_S,
        what="one execution parked at each gate",
    )


STATUSES = "SELECT kind, status, count(*) FROM background_tasks GROUP BY kind, status"
RUNNING = "SELECT kind, id FROM background_tasks WHERE status = 'RUNNING'"


def statuses(engine: sa.Engine) -> Counter[tuple[str, str]]:
    """How many tasks of each (kind, status)."""
    with engine.connect() as conn:
        return Counter({(kind, status): n for kind, status, n in conn.execute(sa.text(STATUSES))})


def running(engine: sa.Engine) -> dict[str, uuid.UUID]:
    """The RUNNING task of each kind: one export and one reminder."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(RUNNING)).all()
    assert sorted(kind for kind, _ in rows) == ["EXPORT", "REMINDER"], rows
    return {kind: task_id for kind, task_id in rows}


def all_completed(engine: sa.Engine) -> bool:
    """Whether every task is COMPLETED; raises as soon as one FAILED."""
    now = statuses(engine)
    assert not [key for key in now if key[1] == "FAILED"], now
    return now == Counter({("EXPORT", "COMPLETED"): EXPORTS, ("REMINDER", "COMPLETED"): REMINDERS})


def listeners(url: str) -> int:
    """The dispatcher's LISTEN sessions on the server at ``url``."""
    conn = psycopg2.connect(url, connect_timeout=2)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (LISTEN_APPLICATION,),
            )
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def alive(proc: Proc) -> bool:
    return proc.popen is not None and proc.popen.poll() is None


def test_the_cluster_survives_a_primary_failover_and_runs_every_task_once(
    primary: SoakPostgres, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    database = f"failover_{uuid.uuid4().hex[:8]}"
    upgrade(primary.create_database(database))
    with streaming_standby(primary) as standby:
        url = two_host_url(primary, standby, database)
        engine = make_engine(url)
        try:
            work = create_workload(engine)
            s = settings.with_overrides(
                database_url=url, heartbeat_ttl_s=4.0, scan_interval_s=1.0, retry_base_delay_s=1.0
            )
            assert s.stale_after_s == 120.0 and s.listen_url == url
            held, promoted_in = run_through_failover(
                s, primary, standby, engine, work, redis_client, tmp_path
            )
        finally:
            engine.dispose()
        print(f"every task completed {promoted_in:.1f} s after the promotion")
        assert_promoted_outcome(standby, database, work, held)


def run_through_failover(
    s: Settings,
    primary: SoakPostgres,
    standby: Standby,
    engine: sa.Engine,
    work: Workload,
    client: redis.Redis,
    tmp_path: Path,
) -> tuple[dict[str, uuid.UUID], float]:
    """Run the cluster, kill the primary with both pool processes parked, promote the
    standby; returns the two interrupted runs (by kind) and how long after the promotion
    every task had completed."""
    keepers = [
        Keeper(client, s.queue_prefix, point, FREE_PASSES) for point in (EXPORT_GATE, REMINDER_GATE)
    ]
    with cluster(tmp_path) as procs:
        w1 = Proc(
            "w1", worker_argv("w1", concurrency=2), settings_env(s, **GATED), tmp_path
        ).start()
        beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
        procs += [w1, beat]
        try:
            park_both(keepers)
            held = running(engine)
            assert_part_done(engine, keepers)
            lsn = primary_wal_lsn(primary)
            wait_for(lambda: standby.has_replayed(lsn), REPLAYED_WITHIN_S, what="the replay")
            engine.dispose()
            primary.stop("immediate")
        finally:
            for keeper in keepers:
                keeper.open(times=EXPORTS + REMINDERS)  # the parked two, and all that follow
        outage = w1.wait_event("heartbeat.failed", timeout=30)
        assert outage["stage"] == "database"
        started = time.monotonic()
        standby.promote()
        wait_for(lambda: all_completed(engine), DONE_WITHIN_S, 0.1, "every task to complete")
        promoted_in = time.monotonic() - started
        wait_for(lambda: listeners(standby.admin_url) == 1, what="LISTEN on the promoted server")
        assert alive(w1) and alive(beat), "a process exited during the failover"
        for proc in (w1, beat):
            proc.send(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, proc.output()[-3000:]
    assert_logs(w1, beat, work, held)
    return held, promoted_in


def assert_part_done(engine: sa.Engine, keepers: list[Keeper]) -> None:
    """Frozen mid-run: every execution let through a gate completed, one of each kind
    runs, the rest wait."""
    exports, reminders = (keeper.arrived - 1 for keeper in keepers)
    assert exports >= FREE_PASSES and reminders >= FREE_PASSES
    assert statuses(engine) == Counter(
        {
            ("EXPORT", "COMPLETED"): exports,
            ("EXPORT", "RUNNING"): 1,
            ("EXPORT", "WAITING"): EXPORTS - exports - 1,
            ("REMINDER", "COMPLETED"): reminders,
            ("REMINDER", "RUNNING"): 1,
            ("REMINDER", "WAITING"): REMINDERS - reminders - 1,
        }
    )


def assert_logs(w1: Proc, beat: Proc, work: Workload, held: dict[str, uuid.UUID]) -> None:
    """The two interrupted attempts failed once each and reported it; every task
    completed once; nothing failed for good; no traceback anywhere."""
    failed = w1.events("task.attempt_failed")
    assert sorted(e["task_id"] for e in failed) == sorted(str(t) for t in held.values())
    assert not [e for e in failed if "report_error" in e or e.get("stage") == "claim"]
    completed = Counter(e["task_id"] for e in w1.events("task.completed"))
    assert completed == Counter(str(task_id) for task_id in work.tasks)
    assert w1.events("task.failed") == []
    assert w1.events("task.lease_lost") == []
    for proc in (w1, beat):
        assert "Traceback" not in proc.output(), proc.output()[-3000:]


def assert_promoted_outcome(
    standby: Standby, database: str, work: Workload, held: dict[str, uuid.UUID]
) -> None:
    """On the promoted server itself: every run completed once, the interrupted two after
    one failed attempt; each reminder's side effects written exactly once."""
    assert not standby.in_recovery()
    engine = make_engine(standby.url(database))
    try:
        for task_id in work.tasks:
            retried = task_id in held.values()
            assert audit_events(engine, task_id) == (RETRIED if retried else ONCE), task_id
            row = task_row(engine, task_id)
            assert (row["status"], row["run"], row["recoveries"]) == ("COMPLETED", 0, 0)
            assert (row["attempts"], row["last_error"]) == (2 if retried else 1, None)
        for task_id in work.exports:
            assert task_row(engine, task_id)["result_summary"] == f"{EXPORT_ROWS} rows"
        assert_reminded_once(engine, work.reminders)
    finally:
        engine.dispose()


def assert_reminded_once(engine: sa.Engine, reminders: dict[uuid.UUID, uuid.UUID]) -> None:
    """One notification, one version bump and one event per reminder, and nothing else."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, version FROM tickets"))
        versions: dict[uuid.UUID, int] = {r.id: r.version for r in rows}
        total = conn.execute(sa.text("SELECT count(*) FROM notifications")).scalar_one()
        events = conn.execute(
            sa.text("SELECT ticket_id, type, payload->>'task_id' FROM system_events")
        ).all()
    for task_id, ticket in reminders.items():
        assert notifications(engine, task_id) == 1, task_id
        assert versions.pop(ticket) == 1, ticket
    assert set(versions.values()) == {0}  # the loose tickets: no reminder
    assert total == len(reminders)
    assert sorted((t, kind, task) for t, kind, task in events) == sorted(
        (ticket, EVENT_TYPE, str(task_id)) for task_id, ticket in reminders.items()
    )
