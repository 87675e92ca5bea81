"""``teamdesk-tasks watch``: following a task against real PostgreSQL until it completes
(exit 0), fails (exit 1 with its last error) or the timeout passes (exit 3), and the
progress lines it prints, one per change or redrawn in place on a terminal."""

from __future__ import annotations

import io
from typing import Any

import pytest
import sqlalchemy as sa

from cli.commands.watch import follow, progress_line
from harness.factories import World, add_tickets
from ledger import lease, service
from tests.support.cli_runner import email_of

pytestmark = pytest.mark.usefixtures("drop_cli_log_handler")


# -- watch ---------------------------------------------------------------------------


def _claimed_export(engine: sa.Engine, world: World, rows: int = 3) -> lease.Lease:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, rows)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        claim = lease.claim(conn, task_id, 0)
    assert claim is not None
    return claim.lease


def test_watch_a_completed_task_exits_0_at_100_percent(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    held = _claimed_export(engine, world)
    with engine.begin() as conn:
        lease.report_progress(conn, held, 40, 30.0)
        lease.complete_export(conn, held, "id,title\n", "3 rows")
    result = cli("watch", str(held.task_id), "--interval", "0.05", "--timeout", "10")
    assert result.code == 0, result.err
    assert result.out == "[##########] 100% COMPLETED run 0 attempt 1\nresult: 3 rows\n"


def test_watch_a_failed_task_exits_1_with_its_last_error(
    cli: Any, engine: sa.Engine, world: World
) -> None:
    held = _claimed_export(engine, world)
    with engine.begin() as conn:
        lease.report_progress(conn, held, 60, 30.0)
        assert lease.report_failure(conn, held, final=True, message="the export failed; try again")
    staff = email_of(engine, world.staff_id)
    result = cli("watch", str(held.task_id), "--user", staff, "--interval", "0.05")
    assert result.code == 1
    assert result.out == "[######....] 60% FAILED run 0 attempt 1\n"
    assert result.err == "task FAILED: the export failed; try again\n"


def test_watch_gives_up_at_its_timeout(cli: Any, engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    result = cli("watch", str(task_id), "--interval", "0.05", "--timeout", "0.2")
    assert result.code == 3
    assert result.out == "[..........] 0% WAITING run 0\n"
    assert result.err == "timed out after 0.2 s; the task is still WAITING\n"


def _views(*states: tuple[str, int, int, int]) -> list[dict[str, Any]]:
    return [
        {
            "status": s,
            "progress": p,
            "run": r,
            "attempts": a,
            "last_error": None,
            "result_summary": "9 rows",
        }
        for s, p, r, a in states
    ]


def _replay(views: list[dict[str, Any] | None], tty: bool) -> tuple[int, str, str]:
    pending = list(views)
    out, err = io.StringIO(), io.StringIO()
    code = follow(
        lambda: pending.pop(0),
        interval=0,
        timeout=None,
        out=out,
        err=err,
        tty=tty,
        sleep=lambda _s: None,
    )
    return code, out.getvalue(), err.getvalue()


def test_watch_prints_one_line_per_change_and_redraws_on_a_terminal() -> None:
    views: list[dict[str, Any] | None] = [
        *_views(("WAITING", 0, 1, 0), ("WAITING", 0, 1, 0), ("RUNNING", 0, 1, 1)),
        None,  # the database did not answer this time
        *_views(("RUNNING", 50, 1, 1), ("RUNNING", 50, 1, 1), ("COMPLETED", 100, 1, 1)),
    ]
    code, out, err = _replay(list(views), tty=False)
    assert code == 0 and err == ""
    assert out.splitlines() == [
        "[..........] 0% WAITING run 1",
        "[..........] 0% RUNNING run 1 attempt 1",
        "[#####.....] 50% RUNNING run 1 attempt 1",
        "[##########] 100% COMPLETED run 1 attempt 1",
        "result: 9 rows",
    ]
    code, out, _ = _replay(list(views), tty=True)
    assert code == 0
    assert out.count("\r") == 4 and "\n" not in out.split("result:")[0][:-1]
    assert out.endswith("\r[##########] 100% COMPLETED run 1 attempt 1\x1b[K\nresult: 9 rows\n")


def test_progress_line_bounds() -> None:
    line = progress_line({"status": "RUNNING", "progress": 99, "run": 0, "attempts": 3})
    assert line == "[#########.] 99% RUNNING run 0 attempt 3"
