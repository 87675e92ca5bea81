"""PostgreSQL failover (docs/design.md, "Topologies"): with ``DATABASE_URL`` listing a
primary and its standby in libpq's form (``postgresql://u@primary,standby/db?
target_session_attrs=read-write``), the primary dying mid-run and the standby's promotion
cost the cluster at most one attempt of each execution the death interrupted: every task
completes exactly once on the promoted server, and no process exits.

Topology: a private primary (soak/postgres.py) and a hot standby streaming from it
(tests/support/pg_standby.py: ``pg_basebackup -R``, asynchronous replication, PostgreSQL's
default), each on a port of its own; the machine's shared PostgreSQL is never touched. The
test database is created and migrated on the primary before the copy. One real worker
(``-c 2``, both queues) and a real beat use the two-host URL for everything: the engines,
the liveness check, the failure reports and the dispatcher's LISTEN connection. 40
exports and 40 reminders (OPEN tickets with a staff assignee) make the workload.

The interleavings are forced by gates, never by sleeps: some tasks of each kind go through,
then both pool processes are parked, each holding a claim, and only then is the primary
killed (``pg_ctl stop -m immediate``) and the parked executions let go. Their connections
are gone and no server takes writes (the standby refuses ``read-write`` sessions); the
worker's liveness check sees the outage (``heartbeat.failed``) before the standby is
promoted (``pg_ctl promote``), and everything left runs on the promoted server.

Which data the promoted server starts with is chosen, not left to chance: with both pool
processes parked, the standby first replays everything the primary has committed, so every
completion is on it; the first test kills the primary there (the two claims survive), the
second cuts replication before the two executions claim (their claims are lost with the
primary). What neither does is lose an acknowledged completion: on a lagging standby a run
the primary had completed can be missing after the promotion, and it then stays RUNNING
under a lease holder whose heartbeat is live (the worker is) until the staleness rule takes
it back, ``STALE_AFTER_S`` later. That is the price of asynchronous replication
(``synchronous_standby_names`` avoids it), not something a test bounded in seconds can
show. For the same reason ``STALE_AFTER_S`` stays at its default, 120 s, far beyond these
tests' bounds: every run completes without the staleness rule, and the exact audit trails
asserted below leave no room for a ``RECOVER``.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from dispatcher.listener import APPLICATION_NAME as LISTEN_APPLICATION
from harness.factories import (
    add_ticket,
    add_tickets,
    audit_events,
    make_world,
    notifications,
    task_row,
)
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate, reached_key
from harness.waiting import wait_for
from ledger import service
from ledger.migrate import upgrade
from soak.postgres import SoakPostgres
from tasks.reminder import EVENT_TYPE
from teamdesk.config import Settings
from teamdesk.db import make_engine
from tests.support.pg_standby import Standby, private_primary, streaming_standby, two_host_url

pytestmark = pytest.mark.slow

EXPORTS = 40
REMINDERS = 40
LOOSE_TICKETS = 10  # unassigned tickets; every export has them and the reminders' tickets
EXPORT_ROWS = LOOSE_TICKETS + REMINDERS  # under EXPORT_BATCH_SIZE: one gate stop per attempt
FREE_PASSES = 8  # executions a gate lets through before it keeps some waiting
EXPORT_GATE = "export.after_read"
REMINDER_GATE = "reminder.after_event_insert"
BEFORE_CLAIM_GATE = "task.before_claim"
CLAIMED_GATE = "task.claimed"
PARKED_WITHIN_S = 60.0  # detects a gate never reached
DONE_WITHIN_S = 45.0  # detects a run left behind (the staleness rule would take 120 s)
OPEN_TOKENS = 1000  # releases more executions than a test makes (redeliveries included)
RETRIED = ["CLAIM", "WAIT", "CLAIM", "COMPLETE"]  # a run whose attempt the failover failed
ONCE = ["CLAIM", "COMPLETE"]  # every other run
LISTEN_STATES = ["listening", "polling", "listening"]  # polling: the primary dead, no promotion


@dataclass(frozen=True)
class Workload:
    exports: list[uuid.UUID]
    reminders: dict[uuid.UUID, uuid.UUID]  # reminder task -> its ticket

    @property
    def tasks(self) -> list[uuid.UUID]:
        return [*self.exports, *self.reminders]


@dataclass(frozen=True)
class Topology:
    primary: SoakPostgres
    standby: Standby
    database: str
    engine: sa.Engine  # through the two-host URL: the primary, then the promoted standby
    work: Workload

    @property
    def url(self) -> str:
        return two_host_url(self.primary, self.standby, self.database)


@pytest.fixture
def topology() -> Iterator[Topology]:
    """The migrated database on a private primary, a standby copied from it and streaming,
    and the workload, created through the two-host URL."""
    database = f"failover_{uuid.uuid4().hex[:8]}"
    with private_primary() as primary:
        upgrade(primary.create_database(database))  # before the copy: the standby has it
        with streaming_standby(primary) as standby:
            engine = make_engine(two_host_url(primary, standby, database))
            try:
                yield Topology(primary, standby, database, engine, create_workload(engine))
            finally:
                engine.dispose()


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


def failover_settings(settings: Settings, top: Topology) -> Settings:
    """The two-host URL for every connection, LISTEN included; quick heartbeats (the worker
    sees the outage and its end within a second), scans and retries; the default
    ``STALE_AFTER_S``."""
    s = settings.with_overrides(
        database_url=top.url, heartbeat_ttl_s=4.0, scan_interval_s=1.0, retry_base_delay_s=1.0
    )
    assert s.stale_after_s == 120.0 and s.listen_url == top.url
    return s


class Keeper:
    """One gate's policy: the first ``free`` executions go through, later ones as
    :meth:`keep` says. Release tokens are anonymous, so which execution waits is read from
    the ledger, not from the arrivals."""

    def __init__(self, client: redis.Redis, prefix: str, point: str, free: int) -> None:
        self.gate = RemoteGate(client, prefix, point)
        self.reached = reached_key(prefix, point)
        self.arrived, self.released = 0, free
        self.gate.release(times=free)

    def keep(self, waiting: int) -> bool:
        """Count the new arrivals and let all but ``waiting`` through; whether exactly
        ``waiting`` executions wait here."""
        while self.gate.client.lpop(self.reached) is not None:
            self.arrived += 1
        excess = self.arrived - self.released - waiting
        if excess > 0:
            self.gate.release(times=excess)
            self.released += excess
        return max(0, self.arrived - self.released) == waiting  # unused tokens: none waits

    def open(self) -> None:
        """Let every execution through from now on."""
        self.gate.release(times=OPEN_TOKENS)


@contextmanager
def opened_at_the_end(keepers: list[Keeper]) -> Iterator[None]:
    try:
        yield
    finally:
        for keeper in keepers:
            keeper.open()


def park(keepers: list[Keeper], waiting: list[int], what: str) -> None:
    """Until each gate keeps its number of executions waiting. Two waiting in all means
    both pool processes are parked (every release token taken) and nothing else runs."""
    wait_for(
        lambda: all([k.keep(n) for k, n in zip(keepers, waiting, strict=True)]),
        timeout=PARKED_WITHIN_S,
        what=what,
    )


@contextmanager
def running_cluster(s: Settings, gates: str, tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    """A real worker (two pool processes, parking at ``gates``) and a real beat."""
    gated = settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES=gates,
        TEAMDESK_TEST_GATE_TIMEOUT_S="600",
    )
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=2), gated, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), settings_env(s), tmp_path).start()
        procs += [w1, beat]
        yield w1, beat


STATUSES = "SELECT kind, status, count(*) FROM background_tasks GROUP BY kind, status"
RUNNING = "SELECT kind, id FROM background_tasks WHERE status = 'RUNNING' ORDER BY kind"


def statuses(engine: sa.Engine) -> Counter[tuple[str, str]]:
    """How many tasks of each (kind, status)."""
    with engine.connect() as conn:
        return Counter({(kind, status): n for kind, status, n in conn.execute(sa.text(STATUSES))})


def running(engine: sa.Engine) -> list[tuple[str, uuid.UUID]]:
    """The RUNNING tasks, with their kinds."""
    with engine.connect() as conn:
        return [(kind, task_id) for kind, task_id in conn.execute(sa.text(RUNNING))]


def all_completed(engine: sa.Engine) -> bool:
    """Whether every task is COMPLETED; raises as soon as one FAILED."""
    now = statuses(engine)
    assert not [key for key in now if key[1] == "FAILED"], now
    return now == Counter({("EXPORT", "COMPLETED"): EXPORTS, ("REMINDER", "COMPLETED"): REMINDERS})


def fail_over(top: Topology, w1: Proc, keepers: list[Keeper]) -> float:
    """Kill the primary, let every parked execution go, wait until the worker saw that no
    server takes writes and paused its intake, promote the standby; returns when
    (monotonic) it was promoted."""
    top.engine.dispose()
    top.primary.stop("immediate")
    for keeper in keepers:
        keeper.open()
    outage = w1.wait_event("heartbeat.failed", timeout=30)
    assert outage["stage"] == "database"
    # The gate: the worker has stopped taking messages (its database check is stale). Not
    # waited for, a promotion quicker than that bound (a busy machine's scheduling) let
    # the next check succeed first, and the pause the test asserts never came.
    w1.wait_event("worker.consuming_paused", timeout=30)
    top.standby.promote()
    return time.monotonic()


def finish(top: Topology, procs: tuple[Proc, Proc], promoted_at: float) -> float:
    """Until every task completed on the promoted server, whose LISTEN session the
    dispatcher holds now; every process is still alive, then stops cleanly. Returns the
    seconds from the promotion to the last completion."""
    wait_for(lambda: all_completed(top.engine), DONE_WITHIN_S, 0.1, "every task to complete")
    done_in = time.monotonic() - promoted_at
    wait_for(lambda: top.standby.sessions(LISTEN_APPLICATION) == 1, what="LISTEN moved there")
    for proc in procs:
        assert proc.popen is not None and proc.popen.poll() is None, f"{proc.name} exited"
    for proc in procs:
        proc.send(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.output()[-3000:]
    return done_in


def task_ids(events: list[dict[str, object]]) -> list[str]:
    return sorted(str(e["task_id"]) for e in events)


def ids(task_ids: Iterable[uuid.UUID]) -> list[str]:
    return sorted(map(str, task_ids))


def assert_logs(
    procs: tuple[Proc, Proc], work: Workload, failed: set[uuid.UUID], revoked: set[uuid.UUID]
) -> None:
    """The worker paused its intake once and resumed it; the dispatcher's LISTEN moved to
    the promoted server; the interrupted executions ended as expected: ``failed`` as a
    failed attempt whose report reached the promoted server, ``revoked`` as a lost lease
    (their claims are not there); every task completed once; nothing failed for good."""
    w1, beat = procs
    assert [len(w1.events(f"worker.consuming_{e}")) for e in ("paused", "resumed")] == [1, 1]
    assert [e["state"] for e in beat.events("dispatcher.listen")] == LISTEN_STATES
    attempts = w1.events("task.attempt_failed")
    assert task_ids(attempts) == ids(failed)
    assert not [e for e in attempts if "report_error" in e or e.get("stage") == "claim"]
    assert task_ids(w1.events("task.lease_lost")) == ids(revoked)
    assert task_ids(w1.events("task.completed")) == ids(work.tasks)
    assert w1.events("task.failed") == []


def assert_no_tracebacks(procs: tuple[Proc, Proc]) -> None:
    """No traceback in any process's output. Before tasks/execution.py invalidated an
    execution connection whose server died under a raw cursor (an export's COPY), the
    pool's reset logged "Exception during reset or similar" with one."""
    found = [line for proc in procs for line in proc.output().splitlines() if "Traceback" in line]
    assert found == [], found[:3]


def assert_promoted_outcome(top: Topology, retried: set[uuid.UUID]) -> None:
    """On the promoted server itself: every run completed once, those in ``retried`` after
    one failed attempt; each reminder's side effects written exactly once."""
    assert not top.standby.in_recovery()
    with top.standby.engine(top.database) as engine:
        for task_id in top.work.tasks:
            again = task_id in retried
            assert audit_events(engine, task_id) == (RETRIED if again else ONCE), task_id
            row = task_row(engine, task_id)
            assert (row["status"], row["run"], row["recoveries"]) == ("COMPLETED", 0, 0)
            assert (row["attempts"], row["last_error"]) == (2 if again else 1, None)
        for task_id in top.work.exports:
            assert task_row(engine, task_id)["result_summary"] == f"{EXPORT_ROWS} rows"
        assert_reminded_once(engine, top.work.reminders)


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


def assert_waiting_on(top: Topology, task_ids: set[uuid.UUID]) -> None:
    """The standby (still in recovery) never saw these tasks' claims."""
    with top.standby.engine(top.database) as engine:
        assert {task_row(engine, t)["status"] for t in task_ids} == {"WAITING"}


def test_a_failover_mid_run_costs_the_interrupted_runs_one_attempt(
    topology: Topology, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The worker parks every export after its read (``export.after_read``) and every
    reminder after its notification, version bump and event are written, before its
    completion commits (``reminder.after_event_insert``). Once some of each went through,
    one execution is kept at each gate: an export with its CSV read and a reminder with
    uncommitted side effects hold the two claims when the primary dies, and the standby
    has replayed them. Each attempt fails on its dead connection; its failure report waits
    for the promotion and lands there (WAIT); the reminder's side effects died with the
    primary's open transaction; both runs retry after the backoff and complete."""
    top, s = topology, failover_settings(settings, topology)
    keepers = [
        Keeper(redis_client, s.queue_prefix, point, FREE_PASSES)
        for point in (EXPORT_GATE, REMINDER_GATE)
    ]
    gates = f"{EXPORT_GATE},{REMINDER_GATE}"
    with running_cluster(s, gates, tmp_path) as procs, opened_at_the_end(keepers):
        park(keepers, [1, 1], "an export and a reminder parked mid-run")
        held = running(top.engine)
        assert [kind for kind, _ in held] == ["EXPORT", "REMINDER"]
        exports, reminders = (keeper.arrived - 1 for keeper in keepers)  # all but the held
        assert min(exports, reminders) >= FREE_PASSES
        assert statuses(top.engine) == Counter(
            {
                ("EXPORT", "COMPLETED"): exports,
                ("EXPORT", "RUNNING"): 1,
                ("EXPORT", "WAITING"): EXPORTS - exports - 1,
                ("REMINDER", "COMPLETED"): reminders,
                ("REMINDER", "RUNNING"): 1,
                ("REMINDER", "WAITING"): REMINDERS - reminders - 1,
            }
        )
        top.standby.catch_up()  # nothing but the dispatcher writes now
        done_in = finish(top, procs, fail_over(top, procs[0], keepers))
    interrupted = {task_id for _, task_id in held}
    assert_logs(procs, top.work, failed=interrupted, revoked=set())
    assert_promoted_outcome(top, retried=interrupted)
    assert_no_tracebacks(procs)
    print(f"every task completed {done_in:.1f} s after the promotion")


def test_claims_lost_with_the_primary_revoke_their_executions(
    topology: Topology, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The claim commits without waiting for the WAL flush (docs/design.md, "Lease"), so
    a failover can lose it. Here it is lost for certain: both pool processes are parked
    before their claims (``task.before_claim``) while the standby replays everything, the
    standby stops receiving WAL, then both claim on the primary and park again
    (``task.claimed``) before the primary dies. On the promoted server both runs are
    WAITING as published: each execution's failure report matches no row (its lease went
    with its claim, ``task.lease_lost``), the dispatcher publishes the run again (its
    message is gone) and it runs once, its first attempt as far as the ledger knows.

    An export among the two meets the dead server in its COPY, on the raw DBAPI cursor;
    its connection is invalidated before it goes back to the pool (tasks/execution.py),
    so the pool logs no "Exception during reset" traceback, as it did before."""
    top, s = topology, failover_settings(settings, topology)
    before = Keeper(redis_client, s.queue_prefix, BEFORE_CLAIM_GATE, FREE_PASSES)
    claimed = Keeper(redis_client, s.queue_prefix, CLAIMED_GATE, 0)
    keepers = [before, claimed]
    gates = f"{BEFORE_CLAIM_GATE},{CLAIMED_GATE}"
    with running_cluster(s, gates, tmp_path) as procs, opened_at_the_end(keepers):
        park(keepers, [2, 0], "both pool processes parked before their claims")
        done_before = before.arrived - 2
        assert done_before >= FREE_PASSES and running(top.engine) == []
        assert (
            sum(n for (_, status), n in statuses(top.engine).items() if status == "COMPLETED")
            == done_before
        )
        top.standby.catch_up()  # nothing but the dispatcher writes now
        top.standby.stop_streaming()
        park(keepers, [0, 2], "both pool processes parked after their claims")
        lost = {task_id for _, task_id in running(top.engine)}
        assert len(lost) == 2
        assert_waiting_on(top, lost)
        done_in = finish(top, procs, fail_over(top, procs[0], keepers))
    assert_logs(procs, top.work, failed=set(), revoked=lost)
    assert_promoted_outcome(top, retried=set())
    print(f"every task completed {done_in:.1f} s after the promotion")
    assert_no_tracebacks(procs)
