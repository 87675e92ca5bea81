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
    # A delivery of the current publish whose row is silent past STALE_AFTER_S takes the
    # lease over.
    (RUNNING, RUNNING): ("claim",),
    (RUNNING, COMPLETED): ("complete_export", "complete_in_transaction"),
    # Retryable error, or the execution's pool process was lost, with attempts left (ready
    # again after the backoff); or the dispatcher takes a silent run back.
    (RUNNING, WAITING): ("report_failure", "report_lost", "recover_stale"),
    # Rejected, or the last attempt; or recovered too many times.
    (RUNNING, FAILED): ("report_failure", "report_lost", "recover_stale"),
    # The claim failed for a lasting cause on the last attempt (with attempts left the
    # row stays WAITING, its attempt counted).
    (WAITING, FAILED): ("refuse_claim",),
    (WAITING, CANCELLED): ("cancel", "cancel_run"),
    (RUNNING, CANCELLED): ("cancel", "cancel_run"),
    (FAILED, WAITING): ("retry",),
    (CANCELLED, WAITING): ("retry",),
}
