"""A worker takes messages only while its heartbeat is registered and its database check
passes (docs/design.md, "Heartbeats"); its heartbeat, and so its leases, never depend on
new database connections.

w1 reaches PostgreSQL through a TCP proxy the test controls. When the proxy refuses new
connections, w1's pooled connections still work but its database check (a new
connection) fails: it stops consuming while its member stays alive, and a healthy worker
takes the message. When the proxy accepts again, w1 consumes again; a w1 started while
the proxy refuses does not consume at all until then; paused once more, a SIGTERM still
stops it cleanly. And an export w1 runs while new connections are refused for longer
than two heartbeat TTLs is never taken back: before, the renewal itself needed a new
connection, the member lapsed, and the dispatcher recovered the live run.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import sqlalchemy as sa

from dispatcher.scan import read_heartbeats, run_once
from harness.databases import through
from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks.celery_app import create_app
from teamdesk.config import Settings
from teamdesk.heartbeat import WorkerSlots, info_key, live_members
from tests.process.test_shutdown import GATED
from tests.support.queues import queued_ids, send_message
from tests.support.tcp_proxy import tcp_proxy
from worker.liveness import renew_interval_s

pytestmark = pytest.mark.slow

TTL_S = 1.0


def export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def offered(client: redis.Redis, prefix: str, member: str) -> tuple[str, ...] | None:
    """The queues ``member``'s last renewal said it consumes."""
    slots = WorkerSlots.from_json(client.get(info_key(prefix, member)))
    return None if slots is None else slots.queues


def started(proc: Proc, task_id: uuid.UUID) -> list[str]:
    return [e["execution"] for e in proc.events("task.started") if e["task_id"] == str(task_id)]


def completed(engine: sa.Engine, task_id: uuid.UUID) -> bool:
    return bool(task_row(engine, task_id)["status"] == "COMPLETED")


def test_a_worker_takes_messages_only_while_its_heartbeat_is_registered(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings.with_overrides(heartbeat_ttl_s=TTL_S)
    first, second, third = export(engine, world), export(engine, world), export(engine, world)
    app = create_app(s)
    target = urlsplit(s.database_url)
    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
        w1_env = settings_env(s, DATABASE_URL=through(s.database_url, proxy.port))
        with cluster(tmp_path) as procs:
            # Never registered: w1 starts without consuming. Two more renewal attempts
            # (each a refused connection) pass on its event loop and the message waits.
            proxy.refuse_new()
            w1 = Proc("w1", worker_argv("w1", concurrency=1), w1_env, tmp_path).start()
            procs.append(w1)
            m1 = w1.wait_event("worker.started")["member"]
            send_message(app, first, 0, "EXPORT")
            attempts = proxy.refused
            wait_for(lambda: proxy.refused >= attempts + 2, what="two more renewal attempts")
            assert queued_ids(redis_client, s.queue_prefix, "exports") == [f"{first}-0"]
            assert audit_events(engine, first) == []

            # Registered: it takes the message (its pool child keeps that connection).
            proxy.accept_new()
            w1.wait_event("worker.consuming_resumed")
            wait_for(lambda: completed(engine, first), what="w1 to complete the first export")

            # New connections refused: the database check fails, w1 stops consuming (its
            # member stays alive), and the message goes to a healthy worker.
            proxy.refuse_new()
            w1.wait_event("worker.consuming_paused", count=2)
            # The pause is in force once w1's heartbeat offers no queue (its consumer
            # deselected them); its member stays alive all along.
            wait_for(lambda: offered(redis_client, s.queue_prefix, m1) == (), what="the pause")
            assert m1 in live_members(redis_client, s.queue_prefix)
            send_message(app, second, 0, "EXPORT")
            w2 = Proc("w2", worker_argv("w2", concurrency=1), settings_env(s), tmp_path).start()
            procs.append(w2)
            wait_for(lambda: completed(engine, second), what="a healthy worker to take it")
            assert started(w1, second) == [] and len(started(w2, second)) == 1
            w2.send(signal.SIGTERM)
            assert w2.wait(timeout=30) == 0

            # The renewal succeeds again: w1 consumes again.
            proxy.accept_new()
            w1.wait_event("worker.consuming_resumed", count=2)
            wait_for(lambda: m1 in live_members(redis_client, s.queue_prefix), what="renewal")
            send_message(app, third, 0, "EXPORT")
            wait_for(lambda: completed(engine, third), what="w1 to take messages again")
            assert len(started(w1, third)) == 1

            # Paused once more, a SIGTERM stops it cleanly, and it never resumes on the way.
            proxy.refuse_new()
            w1.wait_event("worker.consuming_paused", count=3)
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
            proxy.accept_new()
    consuming = [e["event"] for e in w1.lines() if e["event"].startswith("worker.consuming")]
    assert consuming == ["worker.consuming_paused", "worker.consuming_resumed"] * 2 + [
        "worker.consuming_paused"
    ]
    assert [e.get("stage") for e in w1.events("heartbeat.failed")] == ["database"] * 3
    assert w1.events("worker.stopped")[-1]["exit_code"] == 0
    assert len(started(w1, first)) == 1
    for task_id in (first, second, third):
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
        row = task_row(engine, task_id)
        assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
    app.close()


def test_refused_new_connections_never_take_back_a_running_export(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """PostgreSQL refusing new connections (at max_connections, a pooler's limit) for
    three heartbeat TTLs while w1 runs an export on its own connection: the heartbeat
    stays, a dispatcher scan (only the heartbeat rule can act) takes nothing back, and
    the export completes as its first execution."""
    s = settings.with_overrides(heartbeat_ttl_s=TTL_S, export_batch_size=2)
    task_id = export(engine, world)
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")
    app = create_app(s)
    target = urlsplit(s.database_url)
    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
        env = settings_env(s, DATABASE_URL=through(s.database_url, proxy.port), **GATED)
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
            procs.append(w1)
            m1 = w1.wait_event("worker.started")["member"]
            wait_for(
                lambda: read_heartbeats(redis_client, s.queue_prefix, s.heartbeat_ttl_s).trusted,
                what="the heartbeat record to be trusted",
            )
            send_message(app, task_id, 0, "EXPORT")
            parked = gate.wait_reached()  # the first batch read; its progress next
            proxy.refuse_new()
            w1.wait_event("worker.consuming_paused")
            refused = proxy.refused
            # Three TTLs of refused connections, counted by the worker's own attempts.
            wait_for(lambda: proxy.refused >= refused + 3 * 4, what="three TTLs of refusals")
            assert m1 in live_members(redis_client, s.queue_prefix)
            counts = run_once(app, settings=s.with_overrides(stale_after_s=600.0))
            assert (counts.heartbeat_rule, counts.recovered) == (True, 0)
            # Its next write needs a connection of its own (progress during the stream),
            # so it goes on once PostgreSQL takes new connections again.
            proxy.accept_new()
            gate.release(times=3)
            wait_for(lambda: completed(engine, task_id), what="the export to complete")
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
    row = task_row(engine, task_id)
    assert (row["status"], row["attempts"], row["recoveries"]) == ("COMPLETED", 1, 0)
    assert started(w1, task_id) == [parked["execution_id"][:8]]
    assert w1.events("task.lease_lost") == []
    app.close()


def test_a_resumed_worker_offers_its_queues_at_once(
    settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """With the default HEARTBEAT_TTL_S (renewals every 5 s): once intake resumes, the
    heartbeat says which queues the worker consumes right away. Before, the renewal of
    the resuming tick ran before the consumer took its queues back and offered nothing,
    so for one interval the dispatcher sized the window at nothing and could warn that
    no worker consumes the queue."""
    s = settings
    assert s.heartbeat_ttl_s == 20.0
    interval = renew_interval_s(s)
    target = urlsplit(s.database_url)
    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5432) as proxy:
        env = settings_env(s, DATABASE_URL=through(s.database_url, proxy.port))
        with cluster(tmp_path) as procs:
            proxy.refuse_new()  # its first database check fails: it starts paused
            w1 = Proc("w1", worker_argv("w1", queues="exports"), env, tmp_path).start()
            procs.append(w1)
            m1 = w1.wait_event("worker.started")["member"]
            w1.wait_event("worker.consuming_paused")
            wait_for(lambda: offered(redis_client, s.queue_prefix, m1) == (), what="the pause")
            proxy.accept_new()
            w1.wait_event("worker.consuming_resumed", timeout=2 * interval + 5)
            wait_for(
                lambda: offered(redis_client, s.queue_prefix, m1) == ("exports",),
                timeout=interval / 2,
                what="the resumed worker's queues in its heartbeat, before the next renewal",
            )
            w1.send(signal.SIGTERM)
            assert w1.wait(timeout=30) == 0
