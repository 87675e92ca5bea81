"""The two Celery tasks. Each is the shared execution wrapper around one body."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from ledger.errors import TaskRejected
from tasks.execution import TaskFailed, execute
from tasks.export import run_export
from tasks.names import EXPORT_TASK, REMINDER_TASK
from tasks.reminder import run_reminder
from worker.lost import ExecutionRequest


def register(app: Celery) -> None:
    options: dict[str, Any] = {
        "bind": True,
        "shared": False,  # registered on each app explicitly (tests build several)
        "acks_late": True,
        # Issues each delivery's execution id in the main process, and makes a pool process
        # lost mid-task (OOM killer, kill -9) the run's failed attempt within seconds
        # (worker/lost.py). Celery's own re-send after a lost process
        # (retry_on_worker_lost) stays off: it waits default_retry_delay (180 s) in a
        # worker's memory; requeueing (reject_on_worker_lost) would loop forever on a task
        # that kills its process.
        "Request": ExecutionRequest,
        # The ledger is the truth (the API, the CLI and the dispatcher read it) and Flower
        # builds its view from events (task-succeeded carries the return value): a success
        # or a retry is not written to the result backend, a Redis round trip per task.
        # A message that ends FAILURE is (tasks/execution.py, _store_failure). A RETRY
        # stored there would outlive the later attempt's unstored success.
        "ignore_result": True,
        # Expected outcomes: Celery logs them without a traceback.
        "throws": (TaskRejected, TaskFailed),
    }

    # Any args: a message that is not [task_id, run, stamp] is refused by execute() with
    # one warning line (tasks/delivery.py), not by Celery's signature check's traceback.
    @app.task(name=EXPORT_TASK, typing=False, **options)
    def export(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return execute(self, args, kwargs, run_export)

    @app.task(name=REMINDER_TASK, typing=False, **options)
    def reminder(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return execute(self, args, kwargs, run_reminder)
