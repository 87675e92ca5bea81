"""The whole cluster behind a real PgBouncer in transaction pooling (docs/design.md,
"Topologies"): the API creates, the dispatcher publishes (LISTEN on a direct connection,
``DISPATCH_LISTEN_URL``), workers run exports and a reminder, ``health --cluster`` answers
- every other connection through PgBouncer, with ``DATABASE_PREPARED_STATEMENTS=off`` and
fewer server connections than clients. Before, PgBouncer 1.18 refused every heartbeat and
dispatcher connection (``unsupported startup parameter: options``): nothing ran. And no
setting leaks from one client's transaction into the next client's: the claim used to set
``statement_timeout`` for its whole session."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg2
import pytest
import sqlalchemy as sa

from harness.databases import through
from harness.factories import World, add_ticket, add_tickets, audit_events, task_row
from harness.processes import ROOT, Proc, celery_argv, cluster, settings_env, worker_argv
from harness.waiting import wait_for
from teamdesk import config, db
from teamdesk.config import Settings
from tests.support.api_helpers import api_client, bearer, exports_url, make_tokens, reminders_url
from tests.support.pgbouncer import pgbouncer

pytestmark = pytest.mark.slow


def pooled_env(s: Settings, direct_url: str) -> dict[str, str]:
    return settings_env(
        s, DATABASE_PREPARED_STATEMENTS="off", DISPATCH_LISTEN_URL=direct_url, SCAN_INTERVAL_S=1
    )


def create_tasks(s: Settings, engine: sa.Engine, world: World) -> list[uuid.UUID]:
    """Two exports and a reminder through the API, itself through PgBouncer."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 30)
        ticket = add_ticket(conn, world.team_id, world.customer_id, "P", assignee_id=world.staff_id)
    tokens = make_tokens(engine, world)
    config.set_settings(s)
    db.reset_engine()
    created = []
    with api_client(s) as client:
        for _ in range(2):
            answer = client.post(
                exports_url(world.team_id), json={"scope": "TEAM"}, headers=bearer(tokens["staff"])
            )
            assert answer.status_code == 201, answer.text
            created.append(uuid.UUID(answer.json()["id"]))
        answer = client.post(
            reminders_url(world.team_id),
            json={"ticket_id": str(ticket)},
            headers=bearer(tokens["staff"]),
        )
        assert answer.status_code == 201, answer.text
        created.append(uuid.UUID(answer.json()["id"]))
    return created


def test_the_cluster_runs_behind_pgbouncer_in_transaction_pooling(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    direct = settings.database_url
    with pgbouncer() as port:
        s = settings.with_overrides(
            database_url=through(direct, port),
            database_prepared_statements=False,
            dispatch_listen_url=direct,
        )
        tasks = create_tasks(s, engine, world)
        env = pooled_env(s, direct)
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=2), env, tmp_path).start()
            beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
            procs += [w1, beat]
            w1.wait_event("worker.started")
            wait_for(
                lambda: all(task_row(engine, t)["status"] == "COMPLETED" for t in tasks),
                timeout=60,
                what="every task to complete through PgBouncer",
            )
            health = subprocess.run(
                [sys.executable, "-m", "cli.main", "health", "--cluster"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert health.returncode == 0, health.stdout + health.stderr
            # A fresh client of PgBouncer gets a server session some worker used: no
            # setting of theirs is left on it.
            with psycopg2.connect(through(direct, port)) as conn, conn.cursor() as cur:
                cur.execute(
                    "SELECT current_setting('statement_timeout'),"
                    " current_setting('synchronous_commit')"
                )
                assert cur.fetchone() == ("0", "on")
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
        assert not [e for e in w1.lines() if e.get("level") in ("error", "critical")]
        assert w1.events("heartbeat.failed") == []
        assert w1.events("worker.consuming_paused") == []
    for task_id in tasks:
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
        row = task_row(engine, task_id)
        assert (row["attempts"], row["recoveries"], row["last_error"]) == (1, 0, None)
    assert task_row(engine, tasks[0])["result_summary"] == "31 rows"  # the reminder's ticket too
