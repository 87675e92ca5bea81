"""Scale from zero on the real backlog: a real Prometheus (Debian's ``prometheus``) scrapes
a running dispatcher (``celery -A tasks beat``) every second and evaluates the exact query
of deploy/k8s/worker-autoscaling.yaml (read from the file). With no worker at all the
broker holds nothing (the window is sized from live workers), yet the query says 0 when
idle, then 500 with 500 exports waiting; the first worker to start gets work, and the
query falls back to 0 as it drains them - the signal KEDA scales on."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env, worker_argv
from harness.waiting import wait_for
from teamdesk.config import Settings
from tests.support.autoscaling import backlog_query
from tests.support.prometheus import Prometheus

pytestmark = pytest.mark.slow

EXPORTS = 500

# The rows ledger.service would insert for 500 exports, in one statement.
BACKLOG = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
    SELECT 'EXPORT', :team, :owner, 'TEAM', '{}'::jsonb FROM generate_series(1, :n)
""")

LEDGER = sa.text("""
    SELECT count(*) FILTER (WHERE status = 'COMPLETED') AS completed,
           count(*) FILTER (WHERE status NOT IN ('COMPLETED', 'WAITING', 'RUNNING')) AS other
      FROM background_tasks
""")


def broker_holds(client: redis.Redis, prefix: str) -> int:
    return int(client.llen(f"{prefix}:exports")) + int(client.llen(f"{prefix}:reminders"))


def test_the_scaled_objects_query_follows_the_backlog_from_zero_workers(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    query = backlog_query()
    s = settings.with_overrides(scan_interval_s=1.0)
    beat_port = free_port()
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
    with cluster(tmp_path) as procs:
        prom = Prometheus(tmp_path, {"teamdesk-beat": [f"127.0.0.1:{beat_port}"]}).start()
        beat_env = settings_env(s, METRICS_PORT=beat_port)
        beat = Proc("beat", celery_argv("beat"), beat_env, tmp_path).start()
        procs += [prom.proc, beat]
        wait_for(prom.ready, timeout=60, what="Prometheus")
        wait_for(lambda: prom.scalar(query) == 0.0, timeout=60, what="the idle backlog: 0")

        with engine.begin() as conn:
            conn.execute(BACKLOG, {"team": world.team_id, "owner": world.staff_id, "n": EXPORTS})
        wait_for(lambda: prom.scalar(query) == EXPORTS, timeout=60, what="a backlog of 500")
        # No live worker: the dispatcher published nothing, so a queue-length scaler
        # would see an empty queue here.
        assert broker_holds(redis_client, s.queue_prefix) == 0

        worker = Proc("w1", worker_argv("w1", concurrency=2), settings_env(s), tmp_path).start()
        procs.append(worker)
        worker.wait_event("worker.started", timeout=60)

        def drained() -> bool:
            with engine.connect() as conn:
                row = conn.execute(LEDGER).one()
            assert row.other == 0, "an export failed or was cancelled"
            return int(row.completed) == EXPORTS

        wait_for(drained, timeout=240, interval=0.5, what="the first worker to drain 500")
        wait_for(lambda: prom.scalar(query) == 0.0, timeout=60, what="the backlog back to 0")
        # What KEDA would have read over the run: 0, then the backlog, then 0 again (the
        # range's last step can trail the newest sample by up to its 1 s step).
        seen = wait_for(
            lambda: back_to_zero(prom_range_values(prom, query)),
            timeout=30,
            what="the range to end at 0",
        )
    assert seen is not None
    first_backlog = seen.index(EXPORTS)
    assert set(seen[:first_backlog]) == {0.0}, seen
    assert max(seen) == EXPORTS, seen


def back_to_zero(seen: list[float]) -> list[float] | None:
    """``seen`` when it went up to the backlog and came back to 0, else None."""
    if EXPORTS in seen and 0.0 in seen[seen.index(EXPORTS) :]:
        return seen
    return None


def prom_range_values(prom: Prometheus, query: str) -> list[float]:
    data = prom.get("/api/v1/query", query=f"({query})[10m:1s]")
    (series,) = data["result"]
    return [float(value) for _, value in series["values"]]
