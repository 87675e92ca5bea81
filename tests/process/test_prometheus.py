"""Checked by a real Prometheus (Debian's ``prometheus``): it scrapes two workers, the
dispatcher (beat) and the API on loopback every second and evaluates
deploy/prometheus/alerts.yaml every second. A good export goes through the API, a bad
one fails, and a third is parked on a worker that is then SIGKILLed and taken over by
the other; Prometheus's HTTP API then says what the ledger says. Stopping the last worker
puts ``TeamdeskNoLiveWorker`` in ``pending`` (its ``for: 1m`` not yet over)."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, insert_task, task_row
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from ledger.tokens import create_token
from teamdesk.config import Settings
from tests.support.browser import Chromium
from tests.support.prometheus import Prometheus

pytestmark = pytest.mark.slow

EXPORTS_ROUTE = "/api/teams/{team_id}/exports"


SCREENSHOT_ENV = "TEAMDESK_OBSERVE_SCREENSHOT"  # a PNG path: docs/observe-prometheus.png
GRAPHS = (
    "sum by (kind, outcome) (teamdesk_task_duration_seconds_count)",
    "sum by (outcome) (teamdesk_dispatcher_recovered_total)",
)


def graph_url(base: str) -> str:
    params: dict[str, str] = {}
    for i, expr in enumerate(GRAPHS):
        params |= {f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": "1m"}
    return f"{base}/graph?{urllib.parse.urlencode(params)}"


def post_export(base: str, team_id: object, token: str) -> int:
    request = urllib.request.Request(
        f"{base}/api/teams/{team_id}/exports",
        data=json.dumps({"scope": "TEAM", "filters": {}}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status)


def api_up(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/api/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def ledger_counts(engine: sa.Engine) -> dict[str, float]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM background_tasks GROUP BY 1"))
        return {status: float(n) for status, n in rows}


def test_prometheus_sees_tasks_recovery_and_a_pending_alert(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    s = settings.with_overrides(heartbeat_ttl_s=3.0, scan_interval_s=1.0)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 20)
        parked_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        token = create_token(conn, world.staff_id, "prometheus test")
    ports = {name: free_port() for name in ("w1", "w2", "beat", "api-metrics")}
    api_port = free_port()
    base = f"http://127.0.0.1:{api_port}"
    gate = RemoteGate(redis_client, s.queue_prefix, "export.after_read")

    def env(name: str, **extra: object) -> dict[str, str]:
        return settings_env(s, METRICS_PORT=ports[name], **extra)

    gated = env(
        "w1",
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="export.after_read",
        TEAMDESK_TEST_GATE_TIMEOUT_S="120",
    )
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(api_port)]
    jobs = {
        "teamdesk-worker": [f"127.0.0.1:{ports['w1']}", f"127.0.0.1:{ports['w2']}"],
        "teamdesk-beat": [f"127.0.0.1:{ports['beat']}"],
        "teamdesk-api": [f"127.0.0.1:{ports['api-metrics']}"],
    }
    with cluster(tmp_path) as procs:
        prom = Prometheus(tmp_path, jobs).start()
        w1 = Proc("w1", worker_argv("w1", concurrency=1), gated, tmp_path).start()
        beat = Proc("beat", celery_argv("beat"), env("beat"), tmp_path).start()
        api = Proc("api", api_argv, env("api-metrics"), tmp_path).start()
        procs += [prom.proc, w1, beat, api]
        gate.wait_reached(timeout=60)  # the dispatcher published it; w1 holds it, parked
        w2 = Proc("w2", worker_argv("w2", concurrency=2), env("w2"), tmp_path).start()
        procs.append(w2)
        w2.wait_event("worker.started")
        wait_for(lambda: api_up(base), timeout=60, what="the API")
        assert post_export(base, world.team_id, token) == 201
        with engine.begin() as conn:
            bad = insert_task(conn, world, filters={"priority": ["SOMEDAY"]})  # rejected
        w1.send(signal.SIGKILL)
        w1.wait(timeout=10)
        wait_for(
            lambda: ledger_counts(engine) == {"COMPLETED": 2.0, "FAILED": 1.0},
            timeout=60,
            what="two exports completed (one taken over), one failed",
        )
        assert task_row(engine, parked_id)["recoveries"] == 1
        assert task_row(engine, bad)["status"] == "FAILED"
        # A job Prometheus has not scraped yet has no ``up``: the API's target once had none.
        wait_for(prom.scraped_every_target, timeout=30, what="Prometheus to scrape each target")
        ledger = ledger_counts(engine)

        def prometheus_agrees() -> bool:
            tasks = prom.query('sum by (status) (teamdesk_tasks{status=~"COMPLETED|FAILED"})')
            outcomes = prom.query(
                'sum by (outcome) (teamdesk_task_duration_seconds_count{job="teamdesk-worker"})'
            )
            return (
                {dict(k)["status"]: v for k, v in tasks.items()} == ledger
                and {dict(k)["outcome"]: v for k, v in outcomes.items() if v}
                == {"completed": ledger["COMPLETED"], "failed": ledger["FAILED"]}
                and prom.scalar('sum(teamdesk_dispatcher_recovered_total{outcome="waiting"})')
                == 1.0
                # w1's target reads down only once a scrape after its death has failed:
                # the ledger can agree before that scrape (it did, once).
                and prom.targets_up().get("teamdesk-worker") == 0.0
            )

        wait_for(prometheus_agrees, timeout=30, interval=0.5, what="Prometheus to see the ledger")
        assert prom.targets_up() == {
            "teamdesk-worker": 0.0,  # w1, killed
            "teamdesk-beat": 1.0,
            "teamdesk-api": 1.0,
        }
        assert prom.scalar('sum(teamdesk_task_claims_total{kind="export"})') == 3.0  # on w2
        published = prom.scalar("sum(teamdesk_dispatcher_published_total)")
        assert published is not None and published >= 4.0  # the taken-over run twice
        requests = prom.query(f'teamdesk_api_requests_total{{route="{EXPORTS_ROUTE}"}}')
        assert {dict(k)["status"]: v for k, v in requests.items()} == {"201": 1.0}
        assert prom.scalar("teamdesk_dispatcher_leader") == 1.0
        assert prom.scalar("teamdesk_workers_live") == 1.0  # w2 (w1 expired)
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "TeamdeskNoLiveWorker"]

        shoot = os.environ.get(SCREENSHOT_ENV)
        if shoot:  # docs/observability.md: the graph page, rendered by headless Chromium
            Chromium(tmp_path / "chromium").screenshot(
                graph_url(prom.base), Path(shoot), (1280, 1000)
            )

        w2.send(signal.SIGTERM)  # the last worker: no live heartbeat left
        assert w2.wait(timeout=30) == 0

        def no_worker_alert() -> str | None:
            for alert in prom.alerts():
                if alert["labels"]["alertname"] == "TeamdeskNoLiveWorker":
                    return str(alert["state"])
            return None

        wait_for(lambda: no_worker_alert() is not None, timeout=30, what="the alert")
        assert no_worker_alert() == "pending"  # for: 1m
        assert prom.scalar("teamdesk_workers_live") == 0.0
