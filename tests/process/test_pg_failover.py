"""PostgreSQL failover (README, "Production topologies"): with ``DATABASE_URL`` listing a
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
processes parked, the standby first replays all the WAL the primary has inserted, so every
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

import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
FREE_PASSES = 8  # executions a gate lets through before it keeps some waiting
EXPORT_GATE = "export.after_read"
REMINDER_GATE = "reminder.after_event_insert"
BEFORE_CLAIM_GATE = "task.before_claim"
CLAIMED_GATE = "task.claimed"
PARKED_WITHIN_S = 60.0  # detects a gate never reached
REPLAYED_WITHIN_S = 10.0  # detects a standby that stopped streaming
DONE_WITHIN_S = 45.0  # detects a run left behind (the staleness rule would take 120 s)
RETRIED = ["CLAIM", "WAIT", "CLAIM", "COMPLETE"]  # a run whose attempt the failover failed
ONCE = ["CLAIM", "COMPLETE"]  # every other run


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
        """libpq's list: the primary first; only a server that takes writes is accepted."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{self.database}?target_session_attrs=read-write"


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


@pytest.fixture
def topology(primary: SoakPostgres) -> Iterator[Topology]:
    """The migrated database on the primary, a standby copied from it and streaming, and
    the workload, created through the two-host URL."""
    database = f"failover_{uuid.uuid4().hex[:8]}"
    upgrade(primary.create_database(database))
    with streaming_standby(primary) as standby:
        partial = Topology(primary, standby, database, sa.create_engine("sqlite://"), Workload([], {}))
        engine = make_engine(partial.url)
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
