"""Reminder: its side effects and the completion in one transaction of three round trips on
the execution's connection (docs/design.md, "Exports" and "Lifecycle"). The team's lock
proves nothing about the lease (the claim is outside it): the completion's guard decides.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import psycopg2
from sqlalchemy.engine import Connection

from ledger import lease, prepared
from ledger.errors import PermissionLost, TaskRejected
from ledger.permissions import reminder_refusal
from ledger.service import SKIPPED_PREFIX
from tasks.execution import Context
from teamdesk import hooks, tracing
from teamdesk.config import Settings

EVENT_TYPE = "ticket.reminder_sent"
NOTIFICATION_KIND = "TICKET_REMINDER"

MSG_BAD_TICKET = "The reminder does not name a ticket."

TX_BUDGET_S = 15  # every bound of the transaction, so a frozen process frees its team's lock


def tx_budget_s(settings: Settings) -> float:
    """TX_BUDGET_S, or half of STALE_AFTER_S if less: a reminder waiting for the lock must
    give up before its silence passes for a stalled execution."""
    return min(TX_BUDGET_S, settings.stale_after_s / 2)


# One round trip; only the last statement is prepared (ledger/prepared.py).
OPEN_AND_READ = """
    BEGIN;
    SET LOCAL lock_timeout = %(budget_ms)s;
    SET LOCAL statement_timeout = %(budget_ms)s;
    SET LOCAL idle_in_transaction_session_timeout = %(budget_ms)s;
    SELECT pg_advisory_xact_lock(hashtextextended('teamdesk.reminder:' || %(team_id)s, 0));
    SELECT t.status, t.assignee_id, m.role
      FROM tickets t
      LEFT JOIN memberships m ON m.team_id = t.team_id AND m.user_id = t.assignee_id
     WHERE t.id = %(ticket_id)s AND t.team_id = %(team_id)s
       FOR UPDATE OF t
"""

# Each side effect is written through the completed row (``changed``, ledger/lease.py), so
# a lost lease writes none of them.
SEND_AND_COMPLETE = lease.completion_with(
    """, notified AS (
        INSERT INTO notifications (user_id, ticket_id, task_id, kind)
        SELECT CAST(%(assignee_id)s AS uuid), CAST(%(ticket_id)s AS uuid), id,
               CAST(%(kind)s AS text)
          FROM changed
        RETURNING 1
    ), bumped AS (
        UPDATE tickets SET version = version + 1, updated_at = now()
         WHERE id = %(ticket_id)s AND EXISTS (SELECT FROM changed)
        RETURNING 1
    ), recorded AS (
        INSERT INTO system_events (team_id, ticket_id, type, payload)
        SELECT CAST(%(team_id)s AS uuid), CAST(%(ticket_id)s AS uuid), CAST(%(type)s AS text),
               CAST(%(payload)s AS jsonb)
          FROM changed
        RETURNING 1
    )""",
    """, (SELECT count(*) FROM notified), (SELECT count(*) FROM bumped),
        (SELECT count(*) FROM recorded)""",
)


@dataclass(frozen=True)
class Ticket:
    status: str
    assignee_id: object  # a UUID as the driver returns it; None: unassigned
    assignee_role: str | None


def _ticket_id(ctx: Context) -> uuid.UUID:
    try:
        return uuid.UUID(str(ctx.claim.filters["ticket_id"]))
    except (KeyError, ValueError):
        raise TaskRejected(MSG_BAD_TICKET) from None


def _why_not(ticket: Ticket | None) -> str | None:
    """The reason to complete without side effects, or None to send the reminder."""
    if ticket is None:
        return f"{SKIPPED_PREFIX}the ticket no longer exists"
    if ticket.status in ("RESOLVED", "CLOSED"):
        return f"{SKIPPED_PREFIX}the ticket is {ticket.status.lower()}"
    if ticket.assignee_id is None:
        return f"{SKIPPED_PREFIX}the ticket has no assignee"
    if ticket.assignee_role is None:
        return f"{SKIPPED_PREFIX}the assignee left the team"
    return None


def run_reminder(ctx: Context) -> str:
    claim = ctx.claim
    ticket_id = _ticket_id(ctx)
    refusal = reminder_refusal(claim.owner_role)  # as of the claim
    if refusal is not None:
        raise PermissionLost(refusal)
    conn = ctx.conn  # autocommit: the transaction is opened and ended explicitly
    try:
        summary = _in_transaction(conn, ctx, ticket_id)
    except BaseException:
        _rollback(conn)
        raise
    prepared.end_transaction(conn, commit=True)
    tracing.event("reminder.completed", skipped=summary.startswith(SKIPPED_PREFIX))
    return summary


def _in_transaction(conn: Connection, ctx: Context, ticket_id: uuid.UUID) -> str:
    """Lock and read; side effects with the completion; the caller commits or rolls back."""
    claim = ctx.claim
    budget_ms = max(1, round(tx_budget_s(ctx.settings) * 1000))
    params = {"team_id": str(claim.team_id), "ticket_id": str(ticket_id), "budget_ms": budget_ms}
    row = prepared.execute(conn, OPEN_AND_READ, params, budget_ms).fetchone()
    ticket = None if row is None else Ticket(*row)
    hooks.fire("reminder.after_lease_read", claim=claim)
    reason = _why_not(ticket)
    if reason is not None:
        lease.complete_in_transaction(conn, claim.lease, reason)
        return reason
    assert ticket is not None and ticket.assignee_id is not None
    summary = f"reminder sent to {ticket.assignee_id}"
    _send_and_complete(conn, ctx, ticket_id, ticket.assignee_id, summary)
    hooks.fire("reminder.after_event_insert", claim=claim)
    return summary


def _rollback(conn: Connection) -> None:
    """End the failed transaction so the pooled connection is clean; a connection that is
    gone has no transaction left (the pool drops it)."""
    if conn.invalidated or conn.closed:
        return
    try:
        prepared.end_transaction(conn, commit=False)
    except psycopg2.Error:
        conn.invalidate()  # a ROLLBACK that failed leaves nothing worth keeping


def effect_values(claim: lease.Claim, ticket_id: uuid.UUID, assignee: object) -> dict[str, str]:
    """The parameters of :data:`SEND_AND_COMPLETE` beside the lease and the summary."""
    held = claim.lease
    payload = {"task_id": str(held.task_id), "run": held.run, "assignee_id": str(assignee)}
    return {
        "assignee_id": str(assignee),
        "ticket_id": str(ticket_id),
        "kind": NOTIFICATION_KIND,
        "team_id": str(claim.team_id),
        "type": EVENT_TYPE,
        "payload": json.dumps(payload),
    }


def _send_and_complete(
    conn: Connection, ctx: Context, ticket_id: uuid.UUID, assignee: object, summary: str
) -> None:
    values = effect_values(ctx.claim, ticket_id, assignee)
    written = lease.complete_in_transaction(
        conn, ctx.claim.lease, summary, SEND_AND_COMPLETE, **values
    )
    if written != (1, 1, 1):
        raise RuntimeError("reminder side effects were not written exactly once")
