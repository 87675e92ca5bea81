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
    # A recovered or duplicate delivery takes the lease over.
    (RUNNING, RUNNING): ("claim",),
    (RUNNING, COMPLETED): ("complete_export", "complete_in_transaction"),
    # Retryable error with attempts left (ready again after the backoff); or the
    # dispatcher takes a silent run back.
    (RUNNING, WAITING): ("report_failure", "recover_stale"),
    # Rejected, or the last attempt; or recovered too many times.
    (RUNNING, FAILED): ("report_failure", "recover_stale"),
    (WAITING, CANCELLED): ("cancel",),
    (RUNNING, CANCELLED): ("cancel",),
    (FAILED, WAITING): ("retry",),
    (CANCELLED, WAITING): ("retry",),
}
