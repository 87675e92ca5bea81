"""Who may run what: the one home of the permission rules (docs/design.md, "Permissions").

A role is the user's ``memberships.role`` in the task's team, or None when they are not
a member. The rules are checked where a task is asked for (create, retry: the creation's
one statement carries them too, ``MAY_CREATE_*``), again by the worker as of the claim,
and by the export's completion statement itself, so a role change between creation and
the write is honoured. Every refusal has one fixed text, the same in the API's 403, the
CLI and the task's ``last_error``.
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
    """A TEAM-scope task (the whole team's tickets) is seen by the team's staff, and only
    while they are staff: its creator, once demoted, no longer sees it or its CSV. A MINE
    task is seen by its creator while a member. The role is the caller's role now.
    (``LIST_TASKS`` in ledger/service.py says the same in SQL.)"""
    if role is None:
        return False
    return role == STAFF if scope == "TEAM" else owner_id == user_id


def may_export(scope: str, role: str | None) -> bool:
    """A member may export their own tickets (MINE); the whole team's (TEAM) needs staff."""
    return role is not None and (scope != "TEAM" or role == STAFF)


# may_export in SQL, for a statement over ``background_tasks``: the task's owner is a
# member of its team now, and staff when its scope is TEAM. The export's completion
# carries it in its WHERE (ledger/lease.py), so a role change committed before the CSV
# is written stops the write.
MAY_EXPORT_SQL = f"""EXISTS (
    SELECT 1 FROM memberships m
     WHERE m.team_id = background_tasks.team_id AND m.user_id = background_tasks.owner_id
       AND (background_tasks.scope <> 'TEAM' OR m.role = '{STAFF}'))"""


# may_export and may_schedule_reminder in SQL, for a creation in one statement
# (ledger/creation.py): the caller (``%(owner_id)s``) is a member of ``%(team_id)s`` now,
# and staff when the export's ``%(scope)s`` is TEAM, or for a reminder.
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
    """Why a reminder created earlier may no longer be sent (None: it may): its creator
    left the team. (A creator who is no longer staff still gets the reminder sent.)"""
    return MSG_CREATOR_LEFT if creator_role is None else None
