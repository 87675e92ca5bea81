"""The two Celery tasks. Each is the shared execution wrapper around one body."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from ledger.errors import TaskRejected
from tasks.celery_app import EXPORT_TASK, REMINDER_TASK
from tasks.execution import TaskFailed, execute
from tasks.export import run_export
from tasks.reminder import run_reminder
from teamdesk.config import Settings


def register(app: Celery, settings: Settings) -> None:
    options: dict[str, Any] = {
        "bind": True,
        "shared": False,  # registered on each app explicitly (tests build several)
        "acks_late": True,
        # A worker process that dies mid-task sends the message again, counted against the
        # same attempt budget (Celery 5.7). Unbounded reject-and-requeue would let a task
        # that kills its process loop forever.
        "retry_on_worker_lost": True,
        "max_retries": settings.max_task_attempts - 1,
        "default_retry_delay": settings.retry_base_delay_s,
        # Expected outcomes: Celery logs them without a traceback.
        "throws": (TaskRejected, TaskFailed),
    }

    @app.task(name=EXPORT_TASK, **options)
    def export(self: Task, task_id: str, run: int) -> dict[str, Any]:
        return execute(self, task_id, run, run_export)

    @app.task(name=REMINDER_TASK, **options)
    def reminder(self: Task, task_id: str, run: int) -> dict[str, Any]:
        return execute(self, task_id, run, run_reminder)
