"""The logging contract at its most talkative level (docs/design.md, "Logs"): with
LOG_LEVEL=trace, a real API, worker and beat serving every API route and completing an
export and a reminder print no SQL, no request body, no ticket text, no CSV, no token
and no token hash - while still printing at trace."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from harness.factories import World, add_ticket
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env, worker_argv
from harness.waiting import wait_for
from ledger.tokens import create_token, hash_token
from teamdesk.config import Settings
from tests.support.http_calls import call

pytestmark = pytest.mark.slow

TICKET_TEXT = "Zebra-Marker-Title-91"  # in the tickets, the request bodies and the CSV
SQL_WORDS = ("SELECT ", "INSERT INTO", "UPDATE background_tasks", "DELETE FROM", "COPY (")


def test_trace_logs_print_no_sql_body_ticket_text_csv_or_token(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        for i in range(3):
            add_ticket(conn, world.team_id, world.customer_id, f"{TICKET_TEXT} {i}")
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, TICKET_TEXT, assignee_id=world.staff2_id
        )
        token = create_token(conn, world.staff_id, "trace test")
    env = settings_env(settings.with_overrides(log_level="trace"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    with cluster(tmp_path) as procs:
        procs += [
            Proc("api", api_argv, env, tmp_path).start(),
            Proc("worker", worker_argv("w", concurrency=1), env, tmp_path).start(),
            Proc("beat", celery_argv("beat"), env, tmp_path).start(),
        ]
        wait_for(lambda: call(base, "GET", "/api/health")[0] == 200, timeout=60, what="API")
        assert call(base, "GET", "/api/workers/health")[0] in (200, 503)
        team = f"/api/teams/{world.team_id}"
        status, export = call(
            base, "POST", f"{team}/exports", token, {"scope": "TEAM", "filters": {"q": TICKET_TEXT}}
        )
        assert status == 201, export
        status, reminder = call(
            base, "POST", f"{team}/reminders", token, {"ticket_id": str(ticket)}
        )
        assert status == 201, reminder

        def completed(task_id: str) -> bool:
            return bool(
                call(base, "GET", f"/api/tasks/{task_id}", token)[1]["status"] == "COMPLETED"
            )

        for task in (export, reminder):
            wait_for(functools.partial(completed, task["id"]), timeout=60, what="completion")
        status, csv_text = call(base, "GET", f"/api/tasks/{export['id']}/csv", token)
        assert status == 200 and TICKET_TEXT in csv_text
        assert call(base, "GET", f"{team}/tasks", token)[0] == 200
        assert call(base, "POST", f"/api/tasks/{export['id']}/retry", token)[0] == 409
        assert call(base, "POST", f"/api/tasks/{export['id']}/cancel", token)[0] == 409
        assert call(base, "GET", f"/api/tasks/{export['id']}?access_token={token}")[0] == 401
        outputs = {proc.name: proc.output() for proc in procs}
    for name, output in outputs.items():
        lines = [json.loads(line) for line in output.splitlines() if line.strip().startswith("{")]
        assert any(line["level"] in ("debug", "trace") for line in lines), name  # talkative
        for secret in (TICKET_TEXT, token, hash_token(token), *SQL_WORDS):
            assert secret not in output, (name, secret)
    assert '"GET /api/tasks/' in outputs["api"]  # the access log is there, redacted
