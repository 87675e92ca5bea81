"""The task names, their queues and which kind goes where: a leaf module, the one place
every process reads the routing from.
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

# An export's progress to Flower; PENDING ranks lowest, so it never changes the state
# (docs/design.md, "Lease", what Flower shows).
PROGRESS_EVENT = "task-pending"
