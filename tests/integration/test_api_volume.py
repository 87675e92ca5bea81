"""Reads and export volume are metered (docs/design.md, "HTTP API"), in process against
real PostgreSQL and Redis: a token's reads (a task, a list, a CSV) share a budget of their
own (``API_READ_RATE_PER_MIN`` / ``API_READ_BURST``); a team creates at most
``TEAM_EXPORTS_PER_DAY`` exports in 24 hours and none once its exports of the last 24
hours hold ``TEAM_EXPORT_BYTES_PER_DAY`` bytes of CSV (429 with the seconds until the
oldest leaves the window, nothing written; reminders and other teams unaffected); and one
export's CSV is refused past ``EXPORT_MAX_BYTES`` (FAILED with the reason, no CSV kept)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from api.deps import MSG_READ_RATE
from harness.factories import World, add_ticket, add_tickets, audit_events, task_row
from harness.waiting import wait_for
from ledger import lease, service
from ledger.quota import MSG_EXPORT_BYTES_PER_DAY, MSG_EXPORTS_PER_DAY, ExportQuota
from tasks.export import MSG_TOO_LARGE
from teamdesk.config import Settings
from tests.support.api_helpers import api_client, bearer, count_tasks, exports_url, reminders_url
from tests.support.dispatch_scan import other_team
from tests.support.queues import send_message
from tests.support.workers import running_worker

TEAM_EXPORT = {"scope": "TEAM"}
DAY_S = 86_400


def assert_refused(response: Any, message: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json() == {"detail": message}
    assert 0 < int(response.headers["Retry-After"]) <= DAY_S


def test_reads_share_a_budget_of_their_own_per_token(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    limited = settings.with_overrides(api_read_rate_per_min=1, api_read_burst=3)
    staff = bearer(tokens["staff"])
    with api_client(limited) as client:
        created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
        assert created.status_code == 201, created.text  # a creation takes no read
        task = created.json()["id"]
        reads = [
            client.get(f"/api/tasks/{task}", headers=staff),
            client.get(f"/api/teams/{world.team_id}/tasks", headers=staff),
            client.get(f"/api/tasks/{task}/csv", headers=staff),  # 409: not complete, a read
        ]
        assert [r.status_code for r in reads] == [200, 200, 409]
        for path in (f"/api/tasks/{task}", f"/api/teams/{world.team_id}/tasks"):
            refused = client.get(path, headers=staff)
            assert refused.status_code == 429, refused.text
            assert refused.json() == {"detail": MSG_READ_RATE}
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
        other = bearer(tokens["staff2"])  # another token, another budget
        assert client.get(f"/api/tasks/{task}", headers=other).status_code == 200
        cancel = client.post(f"/api/tasks/{task}/cancel", headers=staff)
        assert cancel.status_code == 202, cancel.text  # writes have their own budget
    assert task_row(engine, uuid.UUID(task))["status"] == "CANCELLED"


def test_a_team_creates_at_most_its_daily_quota_of_exports(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    team_b = other_team(engine, "B")
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, assignee_id=world.staff_id)
    with api_client(settings.with_overrides(team_exports_per_day=2)) as client:
        for _ in range(2):
            created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
            assert created.status_code == 201, created.text
        assert_refused(
            client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff),
            MSG_EXPORTS_PER_DAY,
        )
        reminder = client.post(
            reminders_url(world.team_id), json={"ticket_id": str(ticket)}, headers=staff
        )
        assert reminder.status_code == 201, reminder.text  # reminders are not exports
        # Finished exports still count: the quota is what was created in 24 hours.
        for task in client.get(f"/api/teams/{world.team_id}/tasks", headers=staff).json()["tasks"]:
            client.post(f"/api/tasks/{task['id']}/cancel", headers=staff)
        assert_refused(
            client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff),
            MSG_EXPORTS_PER_DAY,
        )
    assert count_tasks(engine) == 3
    with engine.begin() as conn:  # another team has its own quota
        service.create_export(
            conn, team_b.team_id, team_b.staff_id, "TEAM", {}, export_quota=ExportQuota(2, 0)
        )
    with engine.begin() as conn:  # an export older than 24 hours leaves the window
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET created_at = now() - interval '25 hours',"
                " run_opened_at = now() - interval '25 hours'"
                " WHERE team_id = :t AND kind = 'EXPORT'"
            ),
            {"t": world.team_id},
        )
    with api_client(settings.with_overrides(team_exports_per_day=2)) as client:
        created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
        assert created.status_code == 201, created.text


def complete_with(engine: sa.Engine, task_id: uuid.UUID, csv: str) -> None:
    """The ledger's own completion of one run (claim, then complete_export)."""
    with engine.begin() as conn:
        claim = lease.claim(conn, task_id, 0, "host/1")
        assert claim is not None
    with engine.connect() as conn:
        lease.complete_export(
            conn.execution_options(isolation_level="AUTOCOMMIT"), claim.lease, csv, "1 rows"
        )


def test_no_new_export_once_the_days_exports_hold_the_byte_quota(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    csv = "id,title\n" + "x" * 990 + "é\n"  # 1,002 bytes of UTF-8
    # Each unfinished export reserves EXPORT_MAX_BYTES (1,100) until it completes.
    quota = settings.with_overrides(team_export_bytes_per_day=3000, export_max_bytes=1100)
    with api_client(quota) as client:
        first = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
        complete_with(engine, uuid.UUID(first.json()["id"]), csv)
        assert task_row(engine, uuid.UUID(first.json()["id"]))["result_bytes"] == 1002
        second = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
        assert second.status_code == 201, second.text  # 1,002 + 1,100 <= 3,000: room
        complete_with(engine, uuid.UUID(second.json()["id"]), csv)
        assert_refused(
            client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff),
            MSG_EXPORT_BYTES_PER_DAY,
        )
    assert count_tasks(engine) == 2


@pytest.mark.parametrize("max_bytes", [0, 2_000])
def test_one_export_past_the_byte_cap_fails_and_keeps_no_csv(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery], max_bytes: int
) -> None:
    """Fifty tickets make a CSV of about 8 KB: refused at a 2,000-byte cap, stored whole
    (with its size) without one."""
    celery_app = make_app(export_max_bytes=max_bytes)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 50)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with running_worker(celery_app):
        send_message(celery_app, task_id, 0, "EXPORT")
        wait_for(lambda: task_row(engine, task_id)["status"] not in ("WAITING", "RUNNING"))
    row = task_row(engine, task_id)
    if max_bytes:
        assert (row["status"], row["last_error"]) == (
            "FAILED",
            MSG_TOO_LARGE.format(limit=max_bytes),
        )
        assert (row["result_csv"], row["result_bytes"]) == (None, None)
        assert audit_events(engine, task_id) == ["CLAIM", "FAIL"]
    else:
        assert row["status"] == "COMPLETED"
        assert row["result_bytes"] == len(row["result_csv"].encode()) > 2_000
        assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]
