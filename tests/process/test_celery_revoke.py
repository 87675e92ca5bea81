"""Revoke is a cancel (issue 22): what ``celery -A tasks control revoke <id>-<run>`` and
Flower's revoke button (``terminate`` included) do to the ledger.

Real ``celery worker`` and ``celery beat`` (the dispatcher) subprocesses, and the real
``celery`` command line as an operator types it:

- a run published and not yet taken (its worker's consumer cancelled with
  ``control cancel_consumer``) is revoked, then the consumer comes back: the worker
  discards the message, the run ends CANCELLED, and the team's next export (held back by
  TEAM_MAX_RUNNING=1) runs and completes within seconds;
- ``control terminate SIGTERM <id>-<run>`` (the command line's spelling of
  ``revoke --terminate``, what Flower's terminate button sends) kills the pool process
  running an export parked at a gate: the run ends CANCELLED with its lease cleared, the
  worker's main process stays healthy and runs the team's next export;
- a revoke issued before the dispatcher publishes the run it names: the run ends
  CANCELLED when the worker meets its message, and never runs.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import (
    World,
    add_ticket,
    add_tickets,
    audit_events,
    notifications,
    task_row,
)
from harness.processes import Proc, celery_argv, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from teamdesk.config import Settings
from tests.support.operator_commands import (
    celery_lines,
    consumed_queues,
    control,
    held_messages,
    inspect,
    node_of,
    not_json,
    records,
)
from tests.support.queues import queued_ids

pytestmark = pytest.mark.slow

GATE = "export.after_read"
SECONDS = 10.0  # "within seconds": a revoke's effect on the ledger, and the freed slot's use


def export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def reminder(engine: sa.Engine, world: World) -> uuid.UUID:
    """A reminder due now, for a ticket assigned to a staff member (who would be notified)."""
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff2_id)
        return service.create_reminder(conn, world.team_id, world.staff_id, ticket)


def status(engine: sa.Engine, task_id: uuid.UUID) -> str:
    return str(task_row(engine, task_id)["status"])


def revoked_events(worker: Proc) -> dict[str, dict[str, Any]]:
    """The worker's task.revoked lines, by message id (``<task_id>-<run>``)."""
    return {f"{e['task_id']}-{e['run']}": e for e in worker.events("task.revoked")}


def started(worker: Proc, task_id: uuid.UUID) -> list[dict[str, Any]]:
    return [e for e in worker.events("task.started") if e.get("task_id") == str(task_id)]


def assert_no_error_of_ours(worker: Proc) -> None:
    """No traceback anywhere, no task.failed, and no line of our code (an event line) at
    error level; Celery's and billiard's own lines may report a killed pool process."""
    text = worker.output()
    assert "Traceback" not in text, text[-3000:]
    assert not_json(worker) == []
    assert worker.events("task.failed") == []
    ours = [
        line
        for line in records(worker)
        if line["event"] != "log" and line["level"] in ("error", "fatal")
    ]
    assert ours == [], ours


def assert_cancelled(row: dict[str, Any], attempts: int) -> None:
    assert (row["status"], row["run"], row["attempts"]) == ("CANCELLED", 0, attempts)
    assert (row["execution_id"], row["lease_holder"]) == (None, None)


def test_a_revoked_queued_run_ends_cancelled_and_the_teams_next_export_runs(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    # A fixed window: the dispatcher publishes whatever the workers consume meanwhile.
    s = settings.with_overrides(team_max_running=1, dispatch_window=2)
    env = settings_env(s, TEAM_MAX_RUNNING=1, DISPATCH_WINDOW=2)
    prefix = s.queue_prefix
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
        procs.append(w1)
        node = node_of(w1)
        reply = control(s, node, "cancel_consumer", "exports")
        assert "exports" in reply["ok"], reply
        wait_for(
            lambda: "exports" not in consumed_queues(s, node),
            timeout=15,
            interval=0.2,
            what="the worker to stop consuming exports",
        )

        first = export(engine, world)
        beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
        procs.append(beat)
        wait_for(
            lambda: queued_ids(redis_client, prefix, "exports") == [f"{first}-0"],
            timeout=30,
            what="the dispatcher to publish the first export",
        )
        second = export(engine, world)  # the team's slot is taken by the first export
        assert task_row(engine, second)["dispatched_at"] is None

        reply = control(s, node, "revoke", f"{first}-0")
        assert f"{first}-0" in reply["ok"], reply
        resumed = time.monotonic()
        reply = control(s, node, "add_consumer", "exports")
        assert "exports" in reply["ok"], reply

        wait_for(
            lambda: status(engine, second) == "COMPLETED",
            timeout=2 * SECONDS,
            what="the team's next export to complete",
        )
        assert time.monotonic() - resumed < SECONDS
        w1.wait_event("task.revoked", timeout=SECONDS)
        wait_for(
            lambda: held_messages(redis_client, prefix) == 0,
            timeout=SECONDS,
            what="every message acknowledged",
        )
        assert beat.popen is not None and beat.popen.poll() is None

    assert_cancelled(task_row(engine, first), attempts=0)
    assert audit_events(engine, first) == ["CANCEL"]
    done = task_row(engine, second)
    assert (done["status"], done["attempts"], done["result_summary"]) == ("COMPLETED", 1, "3 rows")
    assert audit_events(engine, second) == ["CLAIM", "COMPLETE"]

    revoked = revoked_events(w1)
    assert list(revoked) == [f"{first}-0"]
    assert (revoked[f"{first}-0"]["cancelled"], revoked[f"{first}-0"]["terminated"]) == (
        True,
        False,
    )
    assert len(celery_lines(w1, f"Discarding revoked task: teamdesk.export[{first}-0]")) == 1
    assert started(w1, first) == []
    assert len(started(w1, second)) == 1
    assert_no_error_of_ours(w1)


def test_revoke_terminate_cancels_a_running_export_and_the_worker_stays_healthy(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    # Batches of 2 rows: the export parks after rows 2 and 3 (its last batch).
    s = settings.with_overrides(team_max_running=1, export_batch_size=2)
    env = settings_env(
        s,
        TEAM_MAX_RUNNING=1,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES=GATE,
        TEAMDESK_TEST_GATE_TIMEOUT_S=30,
    )
    # The client's reads may block as long as the gate waits (redis-py's default is 5 s).
    gate_client = redis.Redis.from_url(s.redis_url, socket_timeout=60)
    gate = RemoteGate(gate_client, s.queue_prefix, GATE)
    try:
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
            procs.append(w1)
            node = node_of(w1)
            beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
            procs.append(beat)
            first = export(engine, world)
            parked = gate.wait_reached(timeout=30)
            assert (parked["task_id"], parked["done"]) == (str(first), 2)
            assert status(engine, first) == "RUNNING"
            second = export(engine, world)  # held back while the first one runs

            reply = control(s, node, "terminate", "SIGTERM", f"{first}-0")
            assert reply == {"ok": f"terminate: {first}-0"}
            wait_for(
                lambda: status(engine, first) == "CANCELLED",
                timeout=SECONDS,
                what="the terminated export to be cancelled",
            )
            w1.wait_event("task.revoked", timeout=SECONDS)
            # The slot is free: the next export runs, in the pool's new process.
            w1.wait_event("task.started", timeout=SECONDS, count=2)
            parked_next = gate.wait_reached(timeout=SECONDS)
            assert parked_next["task_id"] == str(second)
            assert parked_next["pid"] != parked["pid"]
            gate.release(times=2)
            wait_for(
                lambda: status(engine, second) == "COMPLETED",
                timeout=SECONDS,
                what="the next export to complete on the same worker",
            )

            wait_for(
                lambda: held_messages(redis_client, s.queue_prefix) == 0,
                timeout=SECONDS,
                what="every message acknowledged",
            )
            assert inspect(s, node, "ping") == {"ok": "pong"}
            assert w1.popen is not None and w1.popen.poll() is None
            with pytest.raises(ProcessLookupError):
                os.kill(parked["pid"], 0)  # the terminated pool process is gone
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
    finally:
        gate.release(times=4)
        gate_client.close()

    assert_cancelled(task_row(engine, first), attempts=1)
    assert audit_events(engine, first) == ["CLAIM", "CANCEL"]
    done = task_row(engine, second)
    assert (done["status"], done["result_summary"]) == ("COMPLETED", "3 rows")
    assert audit_events(engine, second) == ["CLAIM", "COMPLETE"]

    revoked = revoked_events(w1)
    assert list(revoked) == [f"{first}-0"]
    assert (revoked[f"{first}-0"]["cancelled"], revoked[f"{first}-0"]["terminated"]) == (
        True,
        True,
    )
    assert len(celery_lines(w1, f"Terminating {first}-0")) == 1
    assert len(started(w1, first)) == 1  # the terminated run never ran again
    assert w1.events("task.completed") and all(
        e["task_id"] == str(second) for e in w1.events("task.completed")
    )
    assert w1.events("worker.stopped")[-1]["exit_code"] == 0
    assert_no_error_of_ours(w1)


def test_a_revoke_issued_before_the_publish_it_names_cancels_the_run_unrun(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    remind = reminder(engine, world)
    exported = export(engine, world)
    s = settings
    env = settings_env(s)
    prefix = s.queue_prefix
    with cluster(tmp_path) as procs:
        w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
        procs.append(w1)
        node = node_of(w1)
        # No dispatcher yet: neither run is published.
        for task_id in (remind, exported):
            row = task_row(engine, task_id)
            assert (row["status"], row["dispatched_at"]) == ("WAITING", None)
        reply = control(s, node, "revoke", f"{remind}-0", f"{exported}-0")
        assert f"{remind}-0" in reply["ok"] and f"{exported}-0" in reply["ok"], reply

        beat = Proc("beat", celery_argv("beat"), env, tmp_path).start()
        procs.append(beat)
        wait_for(
            lambda: status(engine, remind) == status(engine, exported) == "CANCELLED",
            timeout=2 * SECONDS,
            what="both revoked runs to be cancelled once published",
        )
        w1.wait_event("task.revoked", timeout=SECONDS, count=2)
        wait_for(
            lambda: held_messages(redis_client, prefix) == 0,
            timeout=SECONDS,
            what="every message acknowledged",
        )

    for task_id, name in ((remind, "teamdesk.reminder"), (exported, "teamdesk.export")):
        row = task_row(engine, task_id)
        assert_cancelled(row, attempts=0)
        assert audit_events(engine, task_id) == ["CANCEL"]
        assert len(celery_lines(w1, f"Discarding revoked task: {name}[{task_id}-0]")) == 1
    assert notifications(engine, remind) == 0
    assert w1.events("task.started") == []
    revoked = revoked_events(w1)
    assert sorted(revoked) == sorted([f"{remind}-0", f"{exported}-0"])
    for event in revoked.values():
        assert (event["cancelled"], event["terminated"]) == (True, False), json.dumps(event)
    assert_no_error_of_ours(w1)
