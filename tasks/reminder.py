"""Reminder: one notification, the ticket's version +1 and one system event, committed in
one transaction with the task's completion under the lease (docs/design.md, "Exports"
and "Lifecycle").

The per-team advisory lock serialises reminders of one team; the claim happens outside
it, so holding the lock proves nothing about the lease: the completion's own guard
decides, and a 0-row completion raises LeaseLost, which rolls the whole transaction back
(returning normally would commit the side effects).
"""

from __future__ import annotations

import json
import uuid

from sqlalchemy import text
from sqlalchemy.engine import Connection, Row

from ledger import lease
from ledger.errors import PermissionLost, TaskRejected
from ledger.permissions import reminder_refusal
from ledger.service import role_of
from tasks.execution import Context
from teamdesk import hooks
from teamdesk.config import Settings

EVENT_TYPE = "ticket.reminder_sent"
NOTIFICATION_KIND = "TICKET_REMINDER"

MSG_BAD_TICKET = "The reminder does not name a ticket."

# Every bound of the reminder's transaction. A process frozen inside it (SIGSTOP, a VM
# pause, a half-open connection) would otherwise hold its team's lock for as long as it
# stays frozen: the server ends that session after the budget idle in the transaction,
# which releases the lock, and a reminder waiting for the lock gives up after the same
# time (a failed attempt, retried after the backoff, when the lock is free again). Other
# teams never wait: the lock is per team.
TX_BUDGET_S = 15


def tx_budget_s(settings: Settings) -> float:
    """TX_BUDGET_S, or half of STALE_AFTER_S if that is less: a reminder waiting for its
    team's lock writes nothing to its row, and must give up (a failed attempt) before the
    dispatcher takes that silence for a stalled execution and revokes a live lease."""
    return min(TX_BUDGET_S, settings.stale_after_s / 2)


# The bounds (in ms), then the team's lock, in one round trip.
TEAM_LOCK = text(
    "SET LOCAL lock_timeout = :budget_ms; "
    "SET LOCAL statement_timeout = :budget_ms; "
    "SET LOCAL idle_in_transaction_session_timeout = :budget_ms; "
    "SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.reminder:' || :team_id, 0))"
)
TICKET = text("""
    SELECT id, status, assignee_id FROM tickets
     WHERE id = :ticket_id AND team_id = :team_id FOR UPDATE
""")
# The three side effects in one statement; the completion follows in the same transaction.
SEND = text("""
    WITH notified AS (
        INSERT INTO notifications (user_id, ticket_id, task_id, kind)
        VALUES (:assignee_id, :ticket_id, :task_id, :kind)
        RETURNING 1
    ), bumped AS (
        UPDATE tickets SET version = version + 1, updated_at = now()
         WHERE id = :ticket_id
        RETURNING 1
    ), recorded AS (
        INSERT INTO system_events (team_id, ticket_id, type, payload)
        VALUES (:team_id, :ticket_id, :type, CAST(:payload AS jsonb))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM notified) AS notifications,
           (SELECT count(*) FROM bumped) AS versions,
           (SELECT count(*) FROM recorded) AS events
""")


def _ticket_id(ctx: Context) -> uuid.UUID:
    try:
        return uuid.UUID(str(ctx.claim.filters["ticket_id"]))
    except (KeyError, ValueError):
        raise TaskRejected(MSG_BAD_TICKET) from None


def _why_not(conn: Connection, ctx: Context, ticket: Row[object] | None) -> str | None:
    """The reason to complete without side effects, or None to send the reminder."""
    if ticket is None:
        return "skipped: the ticket no longer exists"
    if ticket.status in ("RESOLVED", "CLOSED"):
        return f"skipped: the ticket is {ticket.status.lower()}"
    if ticket.assignee_id is None:
        return "skipped: the ticket has no assignee"
    if role_of(conn, ctx.claim.team_id, ticket.assignee_id) is None:
        return "skipped: the assignee left the team"
    return None


def run_reminder(ctx: Context) -> str:
    claim = ctx.claim
    ticket_id = _ticket_id(ctx)
    refusal = reminder_refusal(claim.owner_role)  # as of the claim
    if refusal is not None:
        raise PermissionLost(refusal)
    with ctx.engine.begin() as conn:
        conn.execute(
            TEAM_LOCK,
            {
                "team_id": str(claim.team_id),
                "budget_ms": str(max(1, round(tx_budget_s(ctx.settings) * 1000))),
            },
        )
        lease.check_lease(conn, claim.lease)
        hooks.fire("reminder.after_lease_read", claim=claim)
        ticket = conn.execute(
            TICKET, {"ticket_id": ticket_id, "team_id": claim.team_id}
        ).one_or_none()
        reason = _why_not(conn, ctx, ticket)
        if reason is not None:
            lease.complete_in_transaction(conn, claim.lease, reason)
            return reason
        assert ticket is not None
        _send(conn, ctx, ticket_id, ticket.assignee_id)
        hooks.fire("reminder.after_event_insert", claim=claim)
        summary = f"reminder sent to {ticket.assignee_id}"
        lease.complete_in_transaction(conn, claim.lease, summary)
    return summary


def _send(conn: Connection, ctx: Context, ticket_id: uuid.UUID, assignee: uuid.UUID) -> None:
    held = ctx.claim.lease
    payload = {"task_id": str(held.task_id), "run": held.run, "assignee_id": str(assignee)}
    written = conn.execute(
        SEND,
        {
            "assignee_id": assignee,
            "ticket_id": ticket_id,
            "task_id": held.task_id,
            "kind": NOTIFICATION_KIND,
            "team_id": ctx.claim.team_id,
            "type": EVENT_TYPE,
            "payload": json.dumps(payload),
        },
    ).one()
    if (written.notifications, written.versions, written.events) != (1, 1, 1):
        raise RuntimeError("reminder side effects were not written exactly once")
