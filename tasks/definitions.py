"""The two Celery tasks. Each is the shared execution wrapper around one body."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from ledger.errors import TaskRejected
from tasks.execution import TaskFailed, execute
from tasks.export import run_export
from tasks.names import EXPORT_TASK, REMINDER_TASK
from tasks.reminder import run_reminder
from teamdesk.config import Settings


def register(app: Celery, settings: Settings) -> None:
    options: dict[str, Any] = {
        "bind": True,
        "shared": False,  # registered on each app explicitly (tests build several)
        "acks_late": True,
        # A pool process that dies mid-task sends the message again at once (Celery 5.7),
        # at most MAX_TASK_ATTEMPTS - 1 times; the new delivery takes the lease over.
        # Unbounded reject-and-requeue would let a task that kills its process loop forever.
        "retry_on_worker_lost": True,
        "max_retries": settings.max_task_attempts - 1,
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
