"""One ``celery worker`` subprocess with an export parked at a steady gate: the start of
every test that faults the worker's own Redis while an export is in flight (the gate is
kept on a Redis the test does not fault, tests/support/steady_gates.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import Celery

from harness.processes import Proc, cluster, settings_env, worker_argv
from harness.remote_gates import RemoteGate
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support import steady_gates
from tests.support.queues import send_message


@dataclass(frozen=True)
class GatedWorker:
    gate: RemoteGate
    app: Celery  # the test's client of the worker's broker (to send more messages)
    worker: Proc
    member: str  # the worker's heartbeat member, from its worker.started event


@contextmanager
def gated_export_worker(
    s: Settings,
    gate_redis_url: str,
    point: str,
    gate_timeout_s: float,
    task_id: uuid.UUID,
    tmp_path: Path,
) -> Iterator[GatedWorker]:
    """Start w1 (one pool process) with ``s``, parking at ``point`` on ``gate_redis_url``,
    and send it run 0 of the export ``task_id``. The test drives the gate and stops w1; on
    the way out every process still running is stopped and the clients are closed."""
    gate_client = redis.Redis.from_url(gate_redis_url)
    app = create_app(s)
    env = settings_env(s, **steady_gates.worker_env(point, gate_redis_url, gate_timeout_s))
    try:
        with cluster(tmp_path) as procs:
            w1 = Proc("w1", worker_argv("w1", concurrency=1), env, tmp_path)
            procs.append(w1.start())
            member = w1.wait_event("worker.started")["member"]
            send_message(app, task_id, 0, "EXPORT")
            yield GatedWorker(RemoteGate(gate_client, s.queue_prefix, point), app, w1, member)
    finally:
        app.close()
        gate_client.close()
