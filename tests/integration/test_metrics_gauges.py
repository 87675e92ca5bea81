"""The ledger gauges (dispatcher/ledger_gauges.py) on a real ledger, and the API's request
metrics by route template (api/metrics.py)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import sqlalchemy as sa
from celery import Celery
from prometheus_client import CollectorRegistry

from api.metrics import REQUESTS, UNMATCHED
from dispatcher.context import Cluster
from dispatcher.ledger_gauges import READ_ERRORS, LedgerGauges
from harness.factories import World, age_task, insert_task, task_row
from harness.waiting import wait_for
from ledger.dispatch import database_now as _now
from ledger.waiting import backlog_by_kind, top_ready_teams
from teamdesk import metrics
from teamdesk.config import Settings
from tests.support.api_helpers import api_client
from tests.support.dispatch_scan import other_team


def gauges(collector: LedgerGauges) -> dict[tuple[str, tuple[str, ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, tuple(s.labels.values())): s.value for f in registry.collect() for s in f.samples
    }


def database_now(engine: sa.Engine) -> Any:
    with engine.connect() as conn:
        return _now(conn)


def make_due_since(engine: sa.Engine, task_id: uuid.UUID, seconds: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET run_at = now() - make_interval(secs => :s) "
                "WHERE id = :id"
            ),
            {"s": seconds, "id": task_id},
        )


def test_the_leader_reads_the_ledger_once_per_cache_period(
    engine: sa.Engine, world: World, settings: Settings, celery_app: Celery
) -> None:
    with engine.begin() as conn:
        waiting = insert_task(conn, world)
        insert_task(conn, world, kind="REMINDER", status="COMPLETED")
        silent = insert_task(conn, world, status="RUNNING", run=1)
        fresh = insert_task(conn, world, status="RUNNING", run=1)
    make_due_since(engine, waiting, 300)
    age_task(engine, silent, settings.stale_after_s / 2 + 5)
    now = [0.0]
    leading = [True]
    cluster = Cluster(celery_app, settings)
    collector = LedgerGauges(cluster, lambda: leading[0], clock=lambda: now[0])
    try:
        got = gauges(collector)
        assert got[("teamdesk_tasks", ("export", "WAITING"))] == 1
        assert got[("teamdesk_tasks", ("export", "RUNNING"))] == 2
        assert got[("teamdesk_tasks", ("reminder", "COMPLETED"))] == 1
        assert got[("teamdesk_tasks", ("reminder", "FAILED"))] == 0
        assert 300 <= got[("teamdesk_tasks_oldest_waiting_seconds", ("export",))] < 330
        assert got[("teamdesk_tasks_oldest_waiting_seconds", ("reminder",))] == 0
        assert got[("teamdesk_tasks_running_silent", ("export",))] == 1  # not `fresh`
        assert got[("teamdesk_dispatch_window_depth", ("export",))] == 0
        assert got[("teamdesk_workers_live", ())] == 0
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM background_tasks WHERE id = :id"), {"id": fresh})
        assert gauges(collector) == got  # cached
        now[0] = 5.0
        assert gauges(collector)[("teamdesk_tasks", ("export", "RUNNING"))] == 1
        leading[0] = False
        assert gauges(collector) == {}  # a standby serves none
    finally:
        cluster.close()


def test_an_unreachable_database_serves_no_gauge_and_counts_an_error(
    settings: Settings, celery_app: Celery
) -> None:
    down = settings.with_overrides(database_url="postgresql://postgres@127.0.0.1:1/none")
    cluster = Cluster(celery_app, down)
    before = metrics.REGISTRY.get_sample_value("teamdesk_ledger_read_errors_total") or 0.0
    try:
        assert gauges(LedgerGauges(cluster, lambda: True)) == {}
    finally:
        cluster.close()
    assert READ_ERRORS._value.get() == before + 1


def requests(route: str, status: str) -> float:
    labels: dict[str, Any] = {"route": route, "method": "GET", "status": status}
    return metrics.REGISTRY.get_sample_value("teamdesk_api_requests_total", labels) or 0.0


def test_api_requests_are_counted_by_route_template_never_by_id(settings: Settings) -> None:
    task_route = "/api/tasks/{task_id}"
    before = (
        requests(task_route, "401"),
        requests(UNMATCHED, "404"),
        requests("/api/health", "200"),
    )
    with api_client(settings) as client:
        for _ in range(2):
            assert client.get(f"/api/tasks/{uuid.uuid4()}").status_code == 401
        assert client.get("/no/such/route").status_code == 404
        assert client.get("/api/health").status_code == 200
    after = (
        requests(task_route, "401"),
        requests(UNMATCHED, "404"),
        requests("/api/health", "200"),
    )
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 1, 1]
    routes = {
        s.labels["route"] for f in REQUESTS.collect() for s in f.samples if "route" in s.labels
    }
    assert task_route in routes
    assert not [r for r in routes if re.search(r"[0-9a-f]{8}-", r)]  # no id ever


def test_the_backlog_counts_runs_due_and_not_yet_claimed_by_queue(
    engine: sa.Engine, world: World, settings: Settings, celery_app: Celery
) -> None:
    """The autoscaling signal: ready, due-but-not-promoted and published runs count; a
    scheduled run not yet due, a running one and a finished one do not."""
    with engine.begin() as conn:
        ready = insert_task(conn, world)
        published = insert_task(conn, world)
        insert_task(conn, world, status="RUNNING", run=1)
        insert_task(conn, world, status="COMPLETED")
        later = insert_task(conn, world, kind="REMINDER")
        soon = insert_task(conn, world, kind="REMINDER")
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET run_at = now() + interval '1 hour' WHERE id = :id"
            ),
            {"id": later},
        )
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET run_at = now() + interval '300 milliseconds'"
                " WHERE id = :id"
            ),
            {"id": soon},
        )
        conn.execute(
            sa.text("UPDATE background_tasks SET dispatched_at = now() WHERE id = :id"),
            {"id": published},
        )
    make_due_since(engine, ready, 300)
    due_at = task_row(engine, soon)["run_at"]
    wait_for(lambda: database_now(engine) > due_at, timeout=10, what="the reminder's run_at")
    assert task_row(engine, soon)["scheduled"] is True  # due, not yet promoted
    cluster = Cluster(celery_app, settings)
    try:
        got = gauges(LedgerGauges(cluster, lambda: True))
    finally:
        cluster.close()
    assert got[("teamdesk_backlog", ("exports",))] == 2
    assert got[("teamdesk_backlog", ("reminders",))] == 1
    assert 300 <= got[("teamdesk_backlog_oldest_seconds", ("exports",))] < 330
    assert 0 < got[("teamdesk_backlog_oldest_seconds", ("reminders",))] < 30


def test_the_backlog_is_counted_up_to_its_cap(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        for _ in range(5):
            insert_task(conn, world)
    with engine.connect() as conn:
        assert backlog_by_kind(conn, cap=3)["EXPORT"][0] == 3
        assert backlog_by_kind(conn)["EXPORT"][0] == 5
        assert backlog_by_kind(conn)["REMINDER"] == (0, 0.0)


def test_the_top_teams_are_the_busiest_few(engine: sa.Engine, world: World) -> None:
    teams = [world, *(other_team(engine, f"T{i}") for i in range(6))]
    with engine.begin() as conn:
        for i, team in enumerate(teams):
            for _ in range(i + 1):  # team i has i + 1 ready exports
                insert_task(conn, team)
    with engine.connect() as conn:
        top = top_ready_teams(conn, ["EXPORT", "REMINDER"], top=3)
    assert top["EXPORT"] == [(t.team_id, i + 1) for i, t in reversed(list(enumerate(teams)))][:3]
    assert top["REMINDER"] == []
