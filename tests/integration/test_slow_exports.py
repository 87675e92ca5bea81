"""The demo-only slow-export knob (tasks/demo_pause.py): run-local hands it to its workers
only when asked, its value is bounded, and with it on a real export's progress stops at
every batch long enough to be seen (``watch`` reads the ledger once a second)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from cli import localrun
from harness.factories import World, add_tickets, task_row
from harness.waiting import wait_for
from ledger import service
from tasks import demo_pause as slow_exports
from teamdesk import hooks
from tests.support.dispatching import running_cluster


def options(slow: float) -> localrun.LocalOptions:
    return localrun.LocalOptions(1, 2, "pw", False, Path("Procfile"), 0, slow)


def test_run_local_hands_the_knob_to_its_workers_only_when_on() -> None:
    """Only the workers get it: beat and Flower load the same app and printed the DEMO
    ONLY warning for nothing."""
    worker, beat = "celery -A tasks worker -Q exports", "celery -A tasks --quiet beat"
    inherited = {"TEAMDESK_DEMO_SLOW_EXPORT_S": "3", "PATH": "/usr/bin"}
    shared = localrun.child_env(options(0), inherited)
    off = localrun.process_env(options(0), worker, shared, None)
    assert "TEAMDESK_DEMO_SLOW_EXPORT_S" not in off and "TEAMDESK_TEST_HOOKS" not in off
    shared = localrun.child_env(options(2.5), {"PATH": "/usr/bin"})
    on = localrun.process_env(options(2.5), worker, shared, None)
    assert on["TEAMDESK_DEMO_SLOW_EXPORT_S"] == "2.5"
    assert "TEAMDESK_TEST_HOOKS" not in on  # the worker's entry point installs the pause
    assert "TEAMDESK_DEMO_SLOW_EXPORT_S" not in localrun.process_env(
        options(2.5), beat, shared, None
    )
    assert localrun.process_env(options(0), beat, shared, 9102)["METRICS_PORT"] == "9102"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", 0.0),
        ("0", 0.0),
        ("2", 2.0),
        ("5", 5.0),
        ("6", "TEAMDESK_DEMO_SLOW_EXPORT_S must be within 0..5 seconds"),
        ("-1", "TEAMDESK_DEMO_SLOW_EXPORT_S must be within 0..5 seconds"),
        ("soon", "TEAMDESK_DEMO_SLOW_EXPORT_S must be a number of seconds"),
    ],
)
def test_the_knob_is_bounded(raw: str, expected: float | str) -> None:
    env = {"TEAMDESK_DEMO_SLOW_EXPORT_S": raw}
    if isinstance(expected, float):
        assert slow_exports.delay_from_env(env) == expected
    else:
        with pytest.raises(ValueError) as refused:
            slow_exports.delay_from_env(env)
        assert str(refused.value) == expected


def test_an_exports_pauses_stay_under_its_read_budget() -> None:
    slept: list[float] = []
    pause = slow_exports.pauser(2.0, 500, slept.append)
    pause(total=3000, done=500, claim=None)  # 6 batches: 2 s each
    pause(total=10_000, done=500, claim=None)  # 20 batches: 40 s / 20
    pause(total=100_000, done=500, claim=None)  # 200 batches: 0.2 s each
    assert slept == [2.0, 2.0, 0.2]


SAMPLE_FOR_AT_MOST_S = 60.0  # four pauses of 0.6 s: a detector for a stuck export only


def test_with_the_knob_an_exports_progress_can_be_watched(
    engine: sa.Engine, world: World, make_app: Callable[..., Celery]
) -> None:
    app = make_app(export_batch_size=250)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 1000)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    seen: list[tuple[float, int]] = []
    pause = slow_exports.pauser(0.6, 250)
    with hooks.installed("export.after_read", pause), running_cluster(app):
        deadline = time.monotonic() + SAMPLE_FOR_AT_MOST_S
        while (row := task_row(engine, task_id))["status"] in ("WAITING", "RUNNING"):
            assert time.monotonic() < deadline, f"still {row['status']} after the deadline"
            seen.append((time.monotonic(), row["progress"]))
            time.sleep(0.1)  # sampling the ledger as watch does (it reads every second)
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")
    shown = {p for _, p in seen if 0 < p < 100}
    assert shown == {25, 50, 75}  # after the last batch only the completion is written
    times = [t for t, p in seen if p in (25, 50, 75)]
    assert times[-1] - times[0] >= 1.0  # the bar moved over seconds, not milliseconds
    assert task_row(engine, task_id)["result_summary"] == "1000 rows"


def test_a_worker_that_loads_the_knob_says_so_and_pauses_its_exports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TEAMDESK_DEMO_SLOW_EXPORT_S", "1.5")
    before = list(hooks._hooks.get("export.after_read", []))
    slow_exports.install_from_env()
    try:
        (added,) = [h for h in hooks._hooks["export.after_read"] if h not in before]
        assert added.__qualname__ == "pauser.<locals>.pause"
    finally:
        hooks._hooks["export.after_read"].remove(added)
        if not hooks._hooks["export.after_read"]:
            del hooks._hooks["export.after_read"]
    assert capsys.readouterr().err == (
        "DEMO ONLY: TEAMDESK_DEMO_SLOW_EXPORT_S=1.5: every export pauses 1.5 s per batch "
        "(run-local --slow-exports); never set it in production\n"
    )
    monkeypatch.setenv("TEAMDESK_DEMO_SLOW_EXPORT_S", "0")
    slow_exports.install_from_env()
    assert hooks._hooks.get("export.after_read", []) == before


def test_a_bad_value_stops_the_worker_with_one_line_and_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TEAMDESK_DEMO_SLOW_EXPORT_S", "9")
    before = list(hooks._hooks.get("export.after_read", []))
    with pytest.raises(SystemExit) as stopped:
        slow_exports.install_from_env()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "teamdesk-tasks: configuration error: "
        "TEAMDESK_DEMO_SLOW_EXPORT_S must be within 0..5 seconds\n"
    )
    assert hooks._hooks.get("export.after_read", []) == before
