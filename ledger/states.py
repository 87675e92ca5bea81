"""Task kinds, scopes and statuses, and the lifecycle as data (docs/design.md, "Lifecycle").

``docs/state_machine.md`` draws the same transitions; a test checks the two agree.
"""

from __future__ import annotations

KINDS = ("EXPORT", "REMINDER")
SCOPES = ("TEAM", "MINE")

WAITING = "WAITING"
RUNNING = "RUNNING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
STATUSES = (WAITING, RUNNING, COMPLETED, FAILED, CANCELLED)

# (from, to) -> the ledger functions that perform it. Nothing else changes `status`.
ALLOWED_TRANSITIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (WAITING, RUNNING): ("claim",),
    # A delivery whose execution is known to be gone (the row is stale, or Celery re-sent
    # the message after the pool process running it was lost) takes the lease over.
    (RUNNING, RUNNING): ("claim",),
    (RUNNING, COMPLETED): ("complete_export", "complete_in_transaction"),
    # Retryable error with attempts left (ready again after the backoff); or the
    # dispatcher takes a silent run back.
    (RUNNING, WAITING): ("report_failure", "recover_stale"),
    # Rejected, or the last attempt; or recovered too many times.
    (RUNNING, FAILED): ("report_failure", "recover_stale"),
    (WAITING, CANCELLED): ("cancel", "cancel_run"),
    (RUNNING, CANCELLED): ("cancel", "cancel_run"),
    (FAILED, WAITING): ("retry",),
    (CANCELLED, WAITING): ("retry",),
}
