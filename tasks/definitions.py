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
        # The execution id, issued in the main process (worker/lost.py). Requeueing a lost
        # process's message (reject_on_worker_lost) would loop on a task that kills it.
        "Request": ExecutionRequest,
        # FAILURE is stored by tasks/execution.py (docs/design.md, "Lease").
        "ignore_result": True,
        # Expected outcomes: Celery logs them without a traceback.
        "throws": (TaskRejected, TaskFailed),
    }

    # Any args: execute() refuses a bad message in one line, not Celery's traceback.
    @app.task(name=EXPORT_TASK, typing=False, **options)
    def export(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return execute(self, args, kwargs, run_export)

    @app.task(name=REMINDER_TASK, typing=False, **options)
    def reminder(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return execute(self, args, kwargs, run_reminder)
