"""Who may run what: the one home of the permission rules, in Python and in SQL
(docs/design.md, "Permissions"). A role is ``memberships.role``, None for a non-member;
each refusal has one fixed text, the same in a 403, the CLI and ``last_error``.
"""

from __future__ import annotations

import uuid

STAFF = "STAFF"

MSG_TEAM_EXPORT_NEEDS_STAFF = "only staff may export the whole team's tickets"
MSG_REMINDER_NEEDS_STAFF = "only staff may schedule reminders"
MSG_CREATOR_LEFT = "the task's creator is no longer a member of the team"
MSG_CREATOR_NOT_STAFF = (
    "the task's creator is no longer staff; only staff may export the whole team's tickets"
)


def may_see(scope: str, owner_id: uuid.UUID, user_id: uuid.UUID, role: str | None) -> bool:
    """TEAM: the team's staff now; MINE: its creator while a member. (``LIST_TASKS`` in
    ledger/service.py says the same in SQL.)"""
    if role is None:
        return False
    return role == STAFF if scope == "TEAM" else owner_id == user_id


def may_export(scope: str, role: str | None) -> bool:
    """A member may export their own tickets (MINE); the whole team's (TEAM) needs staff."""
    return role is not None and (scope != "TEAM" or role == STAFF)


# may_export in SQL over ``background_tasks`` (the export's completion's WHERE, ledger/lease.py).
MAY_EXPORT_SQL = f"""EXISTS (
    SELECT 1 FROM memberships m
     WHERE m.team_id = background_tasks.team_id AND m.user_id = background_tasks.owner_id
       AND (background_tasks.scope <> 'TEAM' OR m.role = '{STAFF}'))"""


# may_export and may_schedule_reminder in SQL, for the one-statement creation (ledger/creation.py).
MAY_CREATE_EXPORT_SQL = f"""EXISTS (
    SELECT 1 FROM memberships m
     WHERE m.team_id = %(team_id)s AND m.user_id = %(owner_id)s
       AND (CAST(%(scope)s AS text) <> 'TEAM' OR m.role = '{STAFF}'))"""
MAY_CREATE_REMINDER_SQL = f"""EXISTS (
    SELECT 1 FROM memberships m
     WHERE m.team_id = %(team_id)s AND m.user_id = %(owner_id)s AND m.role = '{STAFF}')"""


def may_schedule_reminder(role: str | None) -> bool:
    return role == STAFF


def export_refusal(scope: str, creator_role: str | None) -> str | None:
    """Why an export created earlier may no longer run (None: it may), given its creator's
    role now: they left the team, or a TEAM export's creator is no longer staff."""
    if creator_role is None:
        return MSG_CREATOR_LEFT
    if not may_export(scope, creator_role):
        return MSG_CREATOR_NOT_STAFF
    return None


def reminder_refusal(creator_role: str | None) -> str | None:
    """Why a reminder created earlier may no longer be sent (None: it may): only its
    creator leaving the team stops it."""
    return MSG_CREATOR_LEFT if creator_role is None else None
