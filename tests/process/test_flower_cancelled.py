"""Flower tells the truth about cancelled runs: REVOKED, never PROGRESS or SUCCESS.

Real ``celery worker`` (one pool process), ``celery beat`` (the dispatcher publishes every
run) and Flower, and the real ``celery`` command line. Every export has 5 rows read in
batches of 2, and parks at the remote gate ``export.after_read`` after each batch: parked
after 4 rows, its progress event ``40% (2/5 rows)`` has gone to Flower and its next
ledger write (the progress of 4 rows) is the one a cancel makes fail. In turn:

- A runs and is cancelled the way the API and ``teamdesk-tasks cancel`` do it
  (``ledger.service.cancel``); meanwhile C, published and waiting in the queue behind A,
  is cancelled too. A stops at its next write; C's message is discarded when its turn
  comes. Both show REVOKED; C never shows SUCCESS.
- B runs and is revoked with ``celery -A tasks control revoke <id>-0`` (no terminate):
  the worker cancels its run while it is still parked, and B stops at its next write.
- D runs and is terminated with ``celery -A tasks control terminate SIGTERM <id>-0``.
- E completes (SUCCESS); F is left parked (running) while Chromium renders Flower's task
  list: the running, the completed and the cancelled exports side by side (a screenshot
  in the test's tmp dir; ``TEAMDESK_FLOWER_TASKS_SCREENSHOT=docs/flower-tasks.png`` copies
  it there, which is how docs/observability.md's picture is made).

Every state is read from Flower's own API (``/api/task/info/<id>-<run>``); the ledger,
the result backend, the audit trail and the worker's log lines are checked too.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import (
    ROOT,
    Proc,
    celery_argv,
    cluster,
    free_port,
    settings_env,
    worker_argv,
)
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support.browser import (
    Chromium,
    chromium_for_test,
    png_size,
    skip_reason,
    with_credentials,
)
from tests.support.flower import flower_sees_worker
from tests.support.operator_commands import control, node_of, records

pytestmark = pytest.mark.slow

USER, PASSWORD = "admin", "secret"
AUTH = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
GATE = "export.after_read"
ROWS, BATCH = 5, 2
SHOWN = "40% (2/5 rows)"  # the progress Flower has when an export parks after 4 rows
WINDOW = (1280, 900)
SETTLE_MS = 3000  # virtual time for the task list's scripts to fetch and draw its rows
SCREENSHOT_ENV = "TEAMDESK_FLOWER_TASKS_SCREENSHOT"
SECONDS = 15.0


def flower_task(port: int, message: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/task/info/{message}")
    request.add_header("Authorization", AUTH)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return dict(json.loads(response.read().decode()))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return {}
        raise


def message(task_id: uuid.UUID) -> str:
    return queueing.message_id(task_id, 0)


class Scene:
    """The cluster's handles the steps share."""

    def __init__(
        self, engine: sa.Engine, world: World, settings: Settings, gate: RemoteGate, port: int
    ) -> None:
        self.engine, self.world, self.settings = engine, world, settings
        self.gate, self.port = gate, port

    def export(self) -> uuid.UUID:
        with self.engine.begin() as conn:
            return service.create_export(conn, self.world.team_id, self.world.staff_id, "TEAM", {})

    def park_after_four_rows(self, task_id: uuid.UUID) -> dict[str, Any]:
        """Let ``task_id`` read its first batch, park it after its second, and wait until
        Flower shows the first batch's progress on a running task."""
        for done in (2, 4):
            reached = self.gate.wait_reached(timeout=SECONDS)
            assert (reached["task_id"], reached["done"]) == (str(task_id), done), reached
            if done == 2:
                self.gate.release()
        self.wait_flower(task_id, "STARTED", SHOWN)
        return reached

    def status(self, task_id: uuid.UUID) -> str:
        return str(task_row(self.engine, task_id)["status"])

    def wait_status(self, task_id: uuid.UUID, status: str) -> None:
        wait_for(
            lambda: self.status(task_id) == status,
            timeout=SECONDS,
            what=f"{message(task_id)} to be {status} in the ledger",
        )

    def wait_flower(self, task_id: uuid.UUID, state: str, result: str | None = None) -> None:
        """Wait until Flower shows ``state`` for the run, with ``result`` in its result."""

        def shown() -> bool:
            info = flower_task(self.port, message(task_id))
            shown = str(info.get("result"))
            return info.get("state") == state and (result is None or result in shown)

        try:
            wait_for(shown, timeout=SECONDS, interval=0.1, what="Flower")
        except AssertionError:
            now = flower_task(self.port, message(task_id))
            raise AssertionError(
                f"Flower never showed {message(task_id)} {state} {result or ''}; it shows "
                f"state {now.get('state')!r}, result {now.get('result')!r}"
            ) from None


def task_list_rows(html: str) -> dict[str, str]:
    """Flower's task list, as rendered: the text of each row, by the message id in it."""
    rows: dict[str, str] = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", html, flags=re.S):
        text = " ".join(re.sub(r"<[^>]+>", " ", row).split())
        for found in re.findall(r"[0-9a-f-]{36}-0", text):
            rows[found] = text
    return rows


@pytest.fixture
def browser(tmp_path: Path) -> Chromium | None:
    """Chromium, or None where a person chose ``TEAMDESK_SKIP_BROWSER=1``: the rest of
    the test still runs through Flower's API."""
    return None if skip_reason() is not None else chromium_for_test(tmp_path / "chromium")


def test_flower_shows_every_cancelled_run_revoked(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    browser: Chromium | None,
    tmp_path: Path,
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, ROWS)
    s = settings.with_overrides(export_batch_size=BATCH)
    env = settings_env(
        s,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES=GATE,
        TEAMDESK_TEST_GATE_TIMEOUT_S=60,
    )
    gate_client = redis.Redis.from_url(s.redis_url, socket_timeout=60)
    port = free_port()
    scene = Scene(engine, world, s, RemoteGate(gate_client, s.queue_prefix, GATE), port)
    gate = scene.gate
    tasks_url = with_credentials(f"http://127.0.0.1:{port}/tasks", USER, PASSWORD)
    screenshot = tmp_path / "flower-tasks.png"
    app = create_app(s)
    try:
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path).start()
            flower = Proc(
                "flower",
                celery_argv(
                    "flower",
                    "--address=127.0.0.1",
                    f"--port={port}",
                    f"--basic-auth={USER}:{PASSWORD}",
                ),
                env,
                tmp_path,
            ).start()
            procs += [w1, flower]
            w1.wait_event("worker.started")
            node = node_of(w1)
            wait_for(lambda: flower_sees_worker(port), timeout=30, what="Flower to see w1")
            procs.append(Proc("beat", celery_argv("beat"), env, tmp_path).start())

            # A runs; C is published behind it and waits in the queue.
            a = scene.export()
            scene.park_after_four_rows(a)
            c = scene.export()
            wait_for(
                lambda: task_row(engine, c)["dispatched_at"] is not None,
                timeout=SECONDS,
                what="the dispatcher to publish C",
            )
            with engine.begin() as conn:  # what POST /api/tasks/<id>/cancel does
                service.cancel(conn, c, world.staff_id)
                service.cancel(conn, a, world.staff_id)
            gate.release()
            scene.wait_flower(a, "REVOKED", SHOWN)
            scene.wait_flower(c, "REVOKED")

            # B runs and is revoked (no terminate): cancelled while it is still parked.
            b = scene.export()
            scene.park_after_four_rows(b)
            reply = control(s, node, "revoke", message(b))
            assert message(b) in reply["ok"], reply
            scene.wait_status(b, "CANCELLED")
            gate.release()
            scene.wait_flower(b, "REVOKED", SHOWN)

            # D runs and is terminated.
            d = scene.export()
            parked_d = scene.park_after_four_rows(d)
            reply = control(s, node, "terminate", "SIGTERM", message(d))
            assert reply == {"ok": f"terminate: {message(d)}"}, reply
            scene.wait_status(d, "CANCELLED")
            scene.wait_flower(d, "REVOKED", SHOWN)

            # E completes; F is left running while the task list is rendered.
            e = scene.export()
            for done in (2, 4, 5):
                reached = gate.wait_reached(timeout=SECONDS)
                assert (reached["task_id"], reached["done"]) == (str(e), done), reached
                gate.release()
            scene.wait_flower(e, "SUCCESS", f"{ROWS} rows")
            f = scene.export()
            scene.park_after_four_rows(f)
            if browser is not None:
                html = browser.dump_dom(tasks_url, WINDOW, settle_ms=SETTLE_MS)
                listed = task_list_rows(html)
                browser.screenshot(tasks_url, screenshot, WINDOW, settle_ms=SETTLE_MS)
            shown = {t: flower_task(port, message(t)) for t in (a, b, c, d, e, f)}
            gate.release(times=2)
            scene.wait_status(f, "COMPLETED")
            scene.wait_flower(f, "SUCCESS", f"{ROWS} rows")
            after = {t: flower_task(port, message(t)) for t in (a, b, c, d, e, f)}
            backend = {t: app.AsyncResult(message(t)).state for t in (a, b, c, d)}
    finally:
        gate.release(times=10)
        gate_client.close()
        app.close()

    # Flower: the four cancelled runs REVOKED, never succeeded, and they stay so; the
    # cancelled ones that had run keep the last progress they reported.
    for t in (a, b, c, d):
        for info in (shown[t], after[t]):
            assert (info["state"], info["succeeded"]) == ("REVOKED", None), info
            assert info["revoked"] is not None, info
    for t in (a, b, d):
        assert after[t]["result"] == SHOWN, after[t]
    assert shown[e]["state"] == "SUCCESS" and f"'summary': '{ROWS} rows'" in shown[e]["result"]
    assert (shown[f]["state"], shown[f]["result"]) == ("STARTED", SHOWN)
    assert backend == {t: "REVOKED" for t in (a, b, c, d)}, {
        message(t): v for t, v in backend.items()
    } | {"a": message(a), "c": message(c), "d": message(d)}

    # The task list in a browser: each row says what the ledger says.
    if browser is not None:
        for t in (a, b, c, d):
            assert "REVOKED" in listed.get(message(t), ""), (message(t), listed)
        assert "SUCCESS" in listed.get(message(e), ""), listed
        assert "STARTED" in listed.get(message(f), ""), listed
        assert png_size(screenshot) == WINDOW
        target = os.environ.get(SCREENSHOT_ENV)
        if target:
            path = Path(target) if Path(target).is_absolute() else ROOT / target
            shutil.copyfile(screenshot, path)

    # The ledger: four cancels (C never claimed), two completions.
    for t, attempts, trail in (
        (a, 1, ["CLAIM", "CANCEL"]),
        (b, 1, ["CLAIM", "CANCEL"]),
        (c, 0, ["CANCEL"]),
        (d, 1, ["CLAIM", "CANCEL"]),
    ):
        row = task_row(engine, t)
        assert (row["status"], row["run"], row["attempts"]) == ("CANCELLED", 0, attempts)
        assert (row["execution_id"], row["result_csv"]) == (None, None)
        assert audit_events(engine, t) == trail
    for t in (e, f):
        row = task_row(engine, t)
        assert (row["status"], row["result_summary"]) == ("COMPLETED", f"{ROWS} rows")
        assert audit_events(engine, t) == ["CLAIM", "COMPLETE"]

    # The worker's words: A and B stopped at their next write, C was skipped, B's revoke
    # cancelled a running run, D's terminate a terminated one.
    lines = records(w1)
    cancelled = [x["task_id"] for x in lines if x["event"] == "task.cancelled"]
    assert cancelled == [str(a), str(b)]
    skipped = [x for x in lines if x["event"] == "task.skipped"]
    assert [(x["task_id"], x["reason"]) for x in skipped] == [
        (str(c), "the run has ended (CANCELLED)")
    ]
    revoked = {x["task_id"]: x for x in lines if x["event"] == "task.revoked"}
    assert set(revoked) == {str(b), str(d)}
    assert (revoked[str(b)]["cancelled"], revoked[str(b)]["running"]) == (True, True)
    assert revoked[str(b)]["terminated"] is False
    assert (revoked[str(d)]["cancelled"], revoked[str(d)]["terminated"]) == (True, True)
    assert [x["task_id"] for x in lines if x["event"] == "task.completed"] == [str(e), str(f)]
    assert parked_d["pid"] != reached["pid"]  # the terminated pool process was replaced
    assert "Traceback" not in w1.output()
