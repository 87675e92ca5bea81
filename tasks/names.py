"""Names other modules need: the task names, their queues, and which kind goes where.

A leaf module (it imports nothing of the project), so that the dispatcher, the workers,
the tests and the app builder all read the routing from one place.
"""

from __future__ import annotations

EXPORT_TASK = "teamdesk.export"
REMINDER_TASK = "teamdesk.reminder"
EXPORTS_QUEUE = "exports"
REMINDERS_QUEUE = "reminders"

QUEUE_OF = {EXPORT_TASK: EXPORTS_QUEUE, REMINDER_TASK: REMINDERS_QUEUE}
TASK_OF_KIND = {"EXPORT": EXPORT_TASK, "REMINDER": REMINDER_TASK}
QUEUE_OF_KIND = {kind: QUEUE_OF[task] for kind, task in TASK_OF_KIND.items()}
TASK_QUEUES = (EXPORTS_QUEUE, REMINDERS_QUEUE)
