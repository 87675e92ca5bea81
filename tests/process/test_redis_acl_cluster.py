"""The whole cluster on a Redis whose users are its roles (teamdesk/redis_acl.py), each
process with its own: real ``celery -A tasks worker`` (as deployed: events, mingle and
gossip on), ``celery -A tasks beat`` and ``celery -A tasks flower`` subprocesses, the API
in-process (its own Redis user and database role).

An export and a reminder created through the API complete and the CSV downloads; Flower
sees the worker through the events, asks it over remote control (inspect, pool size,
revoke) and reads the queues' lengths; the worker's own probe passes with its user;
the worker drains and beat stops cleanly. Redis refused none of them anything (its ACL
log is empty), and Flower's user still may not push to a task queue.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_ticket, add_tickets, task_row
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env
from harness.waiting import wait_for
from teamdesk.config import Settings
from tests.support.api_helpers import api_client, bearer, exports_url, make_tokens, reminders_url
from tests.support.redis_users import AclRedis, redis_with_users

pytestmark = pytest.mark.slow

AUTH = "Basic " + base64.b64encode(b"admin:secret").decode()
FAST = {"scan_interval_s": 0.5, "heartbeat_ttl_s": 3.0}


def flower(port: int, path: str, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, headers={"Authorization": AUTH}
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read().decode())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError:
        return 0, None


def role_settings(settings: Settings, acl: AclRedis, role: str) -> Settings:
    url = acl.url(role)
    return settings.with_overrides(redis_url=url, broker_url=url, queue_prefix=acl.prefix, **FAST)


def done(engine: sa.Engine, *task_ids: str) -> bool:
    return all(task_row(engine, uuid.UUID(t))["status"] == "COMPLETED" for t in task_ids)


def test_every_role_runs_with_its_own_redis_user_and_is_refused_nothing(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 20)
        ticket = add_ticket(
            conn, world.team_id, world.customer_id, "Call", assignee_id=world.staff2_id
        )
    staff = bearer(make_tokens(engine, world)["staff"])
    with redis_with_users(f"tdt-{uuid.uuid4().hex[:8]}") as acl, cluster(tmp_path) as procs:
        worker_env = settings_env(role_settings(settings, acl, "worker"), WORKER_INSTANCE_ID="w1")
        argv = celery_argv("worker", "-n", "w1@%h", "-Q", "exports,reminders", "-E", "-c", "2")
        worker = Proc("worker", argv, worker_env, tmp_path).start()
        beat_env = settings_env(role_settings(settings, acl, "beat"))
        beat = Proc("beat", celery_argv("beat"), beat_env, tmp_path).start()
        port = free_port()
        flower_env = settings_env(
            role_settings(settings, acl, "flower"), FLOWER_BASIC_AUTH="admin:secret"
        )
        del flower_env["DATABASE_URL"]
        flower_argv = celery_argv("flower", "--address=127.0.0.1", f"--port={port}")
        flower_proc = Proc("flower", flower_argv, flower_env, tmp_path).start()
        procs += [worker, beat, flower_proc]
        worker.wait_event("worker.started", timeout=60)
        beat.wait_event("dispatcher.leader", timeout=60)

        with api_client(role_settings(settings, acl, "api")) as client:
            export = client.post(
                exports_url(world.team_id), json={"scope": "TEAM", "filters": {}}, headers=staff
            )
            reminder = client.post(
                reminders_url(world.team_id), json={"ticket_id": str(ticket)}, headers=staff
            )
            ids = export.json()["id"], reminder.json()["id"]
            wait_for(lambda: done(engine, *ids), timeout=60, what="the export and the reminder")
            csv = client.get(f"/api/tasks/{ids[0]}/csv", headers=staff)
            workers = client.get("/api/workers/health").json()

        wait_for(lambda: flower(port, "/api/workers?refresh=1")[1], timeout=30, what="Flower")
        seen = flower(port, "/api/workers?refresh=1")[1]
        lengths = flower(port, "/api/queues/length")
        node = next(iter(seen))
        grow = flower(port, f"/api/worker/pool/grow/{node}?n=1", "POST")
        revoke = flower(port, f"/api/task/revoke/{ids[1]}-9", "POST")
        probe = subprocess.run(
            [sys.executable, "-m", "cli.main", "health", "--scope", "w1"],
            env=worker_env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        beat.send(signal.SIGTERM)
        worker.send(signal.SIGTERM)
        exits = beat.wait(timeout=30), worker.wait(timeout=90)
        with pytest.raises(redis.exceptions.NoPermissionError):
            acl.client("flower").lpush(f"{acl.prefix}:exports", "message")
        refused = acl.denials()
    assert (export.status_code, reminder.status_code, csv.status_code) == (201, 201, 200)
    assert len(csv.text.splitlines()) == 1 + 21  # the header, 20 tickets and "Call"
    assert workers["workers"] is True and workers["missing"] == []
    assert node.startswith("w1@") and "registered" in seen[node]
    assert lengths == (
        200,
        {
            "active_queues": [
                {"name": "exports", "messages": 0},
                {"name": "reminders", "messages": 0},
            ]
        },
    )
    assert (grow[0], revoke[0]) == (200, 200)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert exits == (0, 0)
    # Only the test's own try: Flower's user may not even run LPUSH.
    assert [(e["username"], e["reason"], e["object"]) for e in refused] == [
        (f"{acl.prefix}-flower", "command", "lpush")
    ]
