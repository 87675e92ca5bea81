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

# The event that carries an export's progress to Flower (tasks/queueing.py). Celery's
# event state (which Flower keeps) turns a task event's type into a state and lets an
# event change the state only if that state does not rank as "happened before" the
# current one (celery.states.PRECEDENCE). A made-up type such as ``task-progress`` becomes
# a state of its own that outranks REVOKED: a cancelled export stayed PROGRESS forever.
# ``task-pending`` becomes PENDING, the lowest rank: after task-started it only updates
# the fields (the ``result`` text Flower shows) and never the state, so STARTED, then
# SUCCESS, FAILURE or REVOKED, whichever comes, late progress events included.
PROGRESS_EVENT = "task-pending"
