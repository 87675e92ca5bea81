"""The daily export quota counts every new run where it runs, and reserves the most an
unfinished export may store (ledger/quota.py), in process against real PostgreSQL:

- a retry of an export is a new run: refused at the quota like a creation (429, the
  task left as it was), and once in, counted from now - also for an export created on an
  earlier day, which before counted nowhere;
- the bytes quota holds each unfinished export at ``EXPORT_MAX_BYTES`` until its
  completion stores its real size, and a new run gets in only if its own reservation
  fits: the team never holds more than its quota;
- two creations racing for the last reservation: one gets in, the other waits for the
  team's lock, counts after the first committed, and is refused.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import sqlalchemy as sa

from harness.factories import World, audit_events, task_row
from harness.waiting import wait_for
from ledger import lease, service
from ledger.errors import ExportQuotaExceeded
from ledger.quota import MSG_EXPORT_BYTES_PER_DAY, MSG_EXPORTS_PER_DAY, ExportQuota
from teamdesk.config import ConfigError, Settings, load_settings
from tests.support.api_helpers import api_client, bearer, exports_url, waiting_on_a_team_lock

TEAM_EXPORT = {"scope": "TEAM"}
MOST = 1_000  # EXPORT_MAX_BYTES in these tests: what an unfinished export reserves
RACE_TIMEOUT_S = 20.0


def assert_refused(response: Any, message: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json() == {"detail": message}
    assert int(response.headers["Retry-After"]) > 0


def export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def complete_with(engine: sa.Engine, task_id: uuid.UUID, size: int) -> None:
    """Claim and complete the current run with a CSV of ``size`` bytes."""
    run = int(task_row(engine, task_id)["run"])
    with engine.begin() as conn:
        claim = lease.claim(conn, task_id, run, "host/1")
        assert claim is not None
    with engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        lease.complete_export(auto, claim.lease, "x" * (size - 1) + "\n", "1 rows")


def opened_hours_ago(engine: sa.Engine, task_id: uuid.UUID, hours: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET created_at = now() - make_interval(hours => :h),"
                " run_opened_at = now() - make_interval(hours => :h) WHERE id = :id"
            ),
            {"h": hours, "id": task_id},
        )


def test_a_retry_is_a_new_run_counted_by_the_daily_quota(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    yesterdays = export(engine, world)
    with engine.begin() as conn:
        service.cancel(conn, yesterdays, world.staff_id)
    opened_hours_ago(engine, yesterdays, 25)  # out of today's window
    before = task_row(engine, yesterdays)
    retry_url = f"/api/tasks/{yesterdays}/retry"
    with api_client(settings.with_overrides(team_exports_per_day=2)) as client:
        for _ in range(2):
            created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
            assert created.status_code == 201, created.text
        # At the quota: the retry is refused like a creation, and writes nothing.
        assert_refused(client.post(retry_url, headers=staff), MSG_EXPORTS_PER_DAY)
        assert task_row(engine, yesterdays) == before
    with api_client(settings.with_overrides(team_exports_per_day=3)) as client:
        retried = client.post(retry_url, headers=staff)
        assert retried.status_code == 202, retried.text
        # The retried run counts today: the team is at 3 of 3.
        assert_refused(
            client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff),
            MSG_EXPORTS_PER_DAY,
        )
    row = task_row(engine, yesterdays)
    assert (row["status"], row["run"]) == ("WAITING", 1)
    with engine.connect() as conn:
        age = conn.execute(
            sa.text(
                "SELECT now() - run_opened_at < interval '1 minute' FROM background_tasks"
                " WHERE id = :id"
            ),
            {"id": yesterdays},
        ).scalar_one()
    assert age is True
    assert audit_events(engine, yesterdays) == ["CANCEL", "RETRY"]


def test_unfinished_exports_hold_their_most_until_they_complete(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    quota = settings.with_overrides(team_export_bytes_per_day=2_500, export_max_bytes=MOST)
    failed = _failed_export(engine, world)  # ended: it holds nothing

    with api_client(quota) as client:

        def create() -> uuid.UUID:
            created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
            assert created.status_code == 201, created.text
            return uuid.UUID(created.json()["id"])

        def refused() -> None:
            assert_refused(
                client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff),
                MSG_EXPORT_BYTES_PER_DAY,
            )

        first, second = create(), create()  # 2 x 1,000 reserved of 2,500
        refused()  # 2,000 + 1,000 > 2,500: nothing written
        assert _exports(engine, world) == 3
        complete_with(engine, first, 300)  # now 300 + 1,000 held
        third = create()  # 1,300 + 1,000 <= 2,500
        refused()  # 2,300 + 1,000 > 2,500
        # A retry is a new run: it must fit its reservation too.
        assert_refused(
            client.post(f"/api/tasks/{failed}/retry", headers=staff), MSG_EXPORT_BYTES_PER_DAY
        )
        assert task_row(engine, failed)["status"] == "FAILED"
        complete_with(engine, second, 400)
        complete_with(engine, third, 500)  # 1,200 held: one more fits, not two
        create()
        refused()
    assert _exports(engine, world) == 5


def test_two_creations_racing_for_the_last_reservation_let_exactly_one_in(
    engine: sa.Engine, world: World
) -> None:
    """The first creation has counted and inserted, not yet committed; the second starts
    then and must wait for the team's lock, count after the commit and be refused."""
    quota = ExportQuota(per_day=0, bytes_per_day=2 * MOST, reserve_bytes=MOST)
    export(engine, world)  # 1,000 reserved: room for exactly one more
    outcome: dict[str, str] = {}

    def create_second() -> None:
        try:
            with engine.begin() as conn:
                service.create_export(
                    conn, world.team_id, world.staff_id, "TEAM", {}, export_quota=quota
                )
            outcome["second"] = "in"
        except ExportQuotaExceeded:
            outcome["second"] = "refused"

    racer = threading.Thread(target=create_second)
    with engine.connect() as first:
        service.create_export(first, world.team_id, world.staff_id, "TEAM", {}, export_quota=quota)
        racer.start()
        wait_for(
            lambda: not racer.is_alive() or waiting_on_a_team_lock(engine),
            timeout=RACE_TIMEOUT_S,
            what="the second creation to finish or wait for the team's lock",
        )
        first.commit()
    racer.join(RACE_TIMEOUT_S)
    assert outcome == {"second": "refused"}
    assert _exports(engine, world) == 2


def test_the_bytes_quota_needs_room_for_one_export() -> None:
    for env, message in (
        (
            {"TEAM_EXPORT_BYTES_PER_DAY": "1000", "EXPORT_MAX_BYTES": "2000"},
            "TEAM_EXPORT_BYTES_PER_DAY must be 0 (off) or at least EXPORT_MAX_BYTES (2000),"
            " got 1000",
        ),
        (
            {"EXPORT_MAX_BYTES": "0"},
            "EXPORT_MAX_BYTES must be above 0 while TEAM_EXPORT_BYTES_PER_DAY is on (each "
            "unfinished export reserves EXPORT_MAX_BYTES of the quota)",
        ),
    ):
        try:
            load_settings(env)
        except ConfigError as exc:
            assert str(exc) == message
        else:
            raise AssertionError(f"{env} was accepted")
    assert load_settings({"TEAM_EXPORT_BYTES_PER_DAY": "0", "EXPORT_MAX_BYTES": "0"})
    assert load_settings({"TEAM_EXPORT_BYTES_PER_DAY": "2000", "EXPORT_MAX_BYTES": "2000"})


def _exports(engine: sa.Engine, world: World) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM background_tasks WHERE team_id = :t"),
                {"t": world.team_id},
            ).scalar_one()
        )


def _failed_export(engine: sa.Engine, world: World) -> uuid.UUID:
    """An export of today, FAILED (its run reserved nothing once it ended)."""
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with engine.begin() as conn:
        claim = lease.claim(conn, task_id, 0, "host/1")
        assert claim is not None
        assert lease.report_failure(conn, claim.lease, final=True, message="x", retry_in_s=0)
    return task_id
