"""A real ``celery -A tasks worker`` runs a 5,000-row export while real Flower watches:
Flower's task API shows the percent, and it moves batch by batch.

The worker parks after reading each batch (a remote gate) so the test can check what
Flower shows at every step instead of racing a fast export.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, task_row
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support.queues import send_message

pytestmark = pytest.mark.slow

AUTH = "Basic " + base64.b64encode(b"admin:secret").decode()


def flower_get(port: int, path: str, auth: bool = True) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth:
        request.add_header("Authorization", AUTH)
    with urllib.request.urlopen(request, timeout=5) as response:
        body = response.read().decode()
    return json.loads(body) if path.startswith("/api/") else body


def flower_task(port: int, message: str) -> dict[str, Any] | None:
    try:
        return dict(flower_get(port, f"/api/task/info/{message}"))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def flower_sees_worker(port: int) -> bool:
    try:
        metrics = flower_get(port, "/metrics", auth=False)
    except OSError:
        return False
    return 'flower_worker_online{worker="w1@' in metrics


def flower_result(port: int, message: str) -> object:
    return (flower_task(port, message) or {}).get("result")


def shows(port: int, message: str, text: str) -> Callable[[], bool]:
    return lambda: flower_result(port, message) == text


def test_export_progress_moves_in_flower(
    engine: sa.Engine, world: World, settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 5000)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = queueing.message_id(task_id, 0)
    gate = RemoteGate(redis_client, settings.queue_prefix, "export.after_read")
    port = free_port()
    env = settings_env(
        settings,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="export.after_read",
    )
    with cluster(tmp_path) as procs:
        worker = Proc("worker", worker_argv("w1", concurrency=1), env, tmp_path).start()
        flower = Proc(
            "flower",
            celery_argv(
                "flower", "--address=127.0.0.1", f"--port={port}", "--basic-auth=admin:secret"
            ),
            env,
            tmp_path,
        ).start()
        procs += [worker, flower]
        worker.wait_event("worker.started")
        wait_for(lambda: flower_sees_worker(port), timeout=30, what="Flower to see the worker")
        app = create_app(settings)
        try:
            send_message(app, task_id, 0, "EXPORT")
            seen: list[str] = []
            for batch in range(1, 11):
                gate.wait_reached()
                if batch > 1:
                    # Flower may still show the previous batch's text for a moment: wait
                    # for this one's (a wrong or missing text times out).
                    percent = (batch - 1) * 10
                    expected = f"{percent}% ({percent * 50}/5000 rows)"
                    wait_for(
                        shows(port, message, expected),
                        what=f"Flower to show {expected}",
                    )
                    seen.append(str(flower_result(port, message)))
                    assert task_row(engine, task_id)["progress"] == (batch - 1) * 10
                gate.release()
            wait_for(
                lambda: (flower_task(port, message) or {}).get("state") == "SUCCESS",
                what="Flower to show SUCCESS",
            )
        finally:
            gate.release(times=20)
            app.close()
        final = flower_task(port, message)
        with pytest.raises(urllib.error.HTTPError) as denied:
            flower_get(port, f"/api/task/info/{message}", auth=False)
    assert denied.value.code == 401
    assert seen == [f"{p}% ({p * 50}/5000 rows)" for p in range(10, 100, 10)]
    assert final is not None and final["state"] == "SUCCESS"
    row = task_row(engine, task_id)
    assert (row["status"], row["progress"], row["result_summary"]) == (
        "COMPLETED",
        100,
        "5000 rows",
    )
