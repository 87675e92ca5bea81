"""The demo team (``teamdesk-tasks demo-seed``, ``make run``): created once, under an
advisory lock; every run issues fresh tokens and revokes the users' earlier ones of the
same name, so repeated runs leave one live token per user and name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from ledger.tokens import create_token, revoke_named

TEAM_NAME = "Demo Support"
STAFF_EMAIL = "staff@demo.teamdesk.test"
CUSTOMER_EMAIL = "customer@demo.teamdesk.test"
DEFAULT_TICKETS = 3000
SPREAD_DAYS = 42

LOCK = text("SELECT pg_advisory_xact_lock(hashtext('cli.demo-seed'))")

FIND_TEAM = text("""
    SELECT t.id FROM teams t
      JOIN memberships m ON m.team_id = t.id AND m.role = 'STAFF'
      JOIN users u ON u.id = m.user_id
     WHERE t.name = :team_name AND lower(u.email) = lower(:staff_email)
     ORDER BY t.created_at, t.id
     LIMIT 1
""")

INSERT_TEAM = text("INSERT INTO teams (name) VALUES (:name) RETURNING id")

UPSERT_USER = text("""
    INSERT INTO users (email, name) VALUES (:email, :name)
    ON CONFLICT (email) DO UPDATE SET name = users.name
    RETURNING id
""")

USER_ID = text("SELECT id FROM users WHERE lower(email) = lower(:email)")

INSERT_MEMBER = text("""
    INSERT INTO memberships (team_id, user_id, role) VALUES (:team_id, :user_id, :role)
    ON CONFLICT (team_id, user_id) DO UPDATE SET role = EXCLUDED.role
""")

TITLES = (  # exercise the CSV rules (docs/design.md, "Exports")
    "Printer on the 3rd floor jams, again",
    'Refund for order "A-{n}" not received',
    "Cannot log in after password reset",
    "=SUM(A1:A9) shows up in my invoice",
    'Café Wi-Fi: "guest" network drops, every hour',
    "+1 555 0100 asks for a callback",
    "-15% discount not applied at checkout",
    "@channel mention sends no notification",
    "Export button greyed out for ticket {n}",
    "VPN, DNS and the proxy: which one is it?",
)

INSERT_TICKETS = text("""
    INSERT INTO tickets (team_id, title, status, priority, requester_id, assignee_id,
                         due_at, created_at, updated_at)
    SELECT :team_id,
           replace((CAST(:titles AS text[]))[1 + g % cardinality(CAST(:titles AS text[]))],
                   '{n}', CAST(1000 + g AS text)),
           (ARRAY['OPEN', 'PENDING', 'RESOLVED', 'CLOSED'])[1 + (g * 7 + g / 10) % 4],
           (ARRAY['LOW', 'NORMAL', 'NORMAL', 'HIGH', 'URGENT'])[1 + (g * 3 + g / 7) % 5],
           CASE WHEN g % 5 = 0 THEN :staff_id ELSE :customer_id END,
           CASE WHEN g % 3 = 0 THEN CAST(:staff_id AS uuid) END,
           CASE WHEN g % 4 = 0 THEN created + interval '3 days' END,
           created,
           LEAST(now(), created + (g % 48) * interval '1 hour')
      FROM (SELECT g, now() - make_interval(days => :days)
                      + g * (make_interval(days => :days) / :count) AS created
              FROM generate_series(1, :count) AS g) AS spread
""")

COUNT_TICKETS = text("SELECT count(*) FROM tickets WHERE team_id = :team_id")

# A ticket a reminder would really be sent for (open, assigned to the staff user), newest
# first: the banner's ready-to-paste reminder. A closed one would end "skipped".
REMINDER_TICKET = text("""
    SELECT t.id FROM tickets t JOIN users u ON u.id = t.assignee_id
     WHERE t.team_id = :team_id AND t.status = 'OPEN' AND lower(u.email) = lower(:staff_email)
     ORDER BY t.created_at DESC, t.id
     LIMIT 1
""")


@dataclass(frozen=True)
class DemoUser:
    email: str
    role: str
    user_id: uuid.UUID
    token: str | None = None


@dataclass(frozen=True)
class DemoTeam:
    team_id: uuid.UUID
    created: bool
    tickets: int
    users: list[DemoUser] = field(default_factory=list)
    revoked_tokens: int = 0  # the users' earlier live tokens of the same name
    token_name: str | None = None
    reminder_ticket: uuid.UUID | None = None  # open, assigned to the staff user

    @property
    def staff(self) -> DemoUser:
        return next(u for u in self.users if u.role == "STAFF")

    def as_dict(self) -> dict[str, Any]:
        return {
            "team_id": str(self.team_id),
            "team_name": TEAM_NAME,
            "created": self.created,
            "tickets": self.tickets,
            "revoked_tokens": self.revoked_tokens,
            "reminder_ticket": None if self.reminder_ticket is None else str(self.reminder_ticket),
            "users": [
                {"email": u.email, "role": u.role, "user_id": str(u.user_id), "token": u.token}
                for u in self.users
            ],
        }


def _user(conn: Connection, email: str, name: str) -> uuid.UUID:
    return uuid.UUID(str(conn.execute(UPSERT_USER, {"email": email, "name": name}).scalar_one()))


def _create(conn: Connection, tickets: int) -> uuid.UUID:
    team_id = uuid.UUID(str(conn.execute(INSERT_TEAM, {"name": TEAM_NAME}).scalar_one()))
    staff = _user(conn, STAFF_EMAIL, "Demo Staff")
    customer = _user(conn, CUSTOMER_EMAIL, "Demo Customer")
    for user_id, role in ((staff, "STAFF"), (customer, "CUSTOMER")):
        conn.execute(INSERT_MEMBER, {"team_id": team_id, "user_id": user_id, "role": role})
    params = {
        "team_id": team_id,
        "titles": list(TITLES),
        "staff_id": staff,
        "customer_id": customer,
        "days": SPREAD_DAYS,
        "count": tickets,
    }
    if tickets > 0:
        conn.execute(INSERT_TICKETS, params)
    return team_id


def _users(conn: Connection, token_name: str | None) -> tuple[list[DemoUser], int]:
    """The demo users with a new token each (after revoking their earlier live tokens of
    that name), and how many were revoked."""
    ids = {
        email: uuid.UUID(str(conn.execute(USER_ID, {"email": email}).scalar_one()))
        for email in (STAFF_EMAIL, CUSTOMER_EMAIL)
    }
    revoked = revoke_named(conn, list(ids.values()), token_name) if token_name else 0
    users = []
    for email, role in ((STAFF_EMAIL, "STAFF"), (CUSTOMER_EMAIL, "CUSTOMER")):
        token = create_token(conn, ids[email], token_name) if token_name else None
        users.append(DemoUser(email, role, ids[email], token))
    return users, revoked


def seed(
    conn: Connection, tickets: int = DEFAULT_TICKETS, token_name: str | None = "demo-seed"
) -> DemoTeam:
    """Create the demo team once; issue one new token per user, revoking their earlier
    tokens named ``token_name`` (no tokens at all if it is None). Runs in the caller's
    transaction."""
    conn.execute(LOCK)
    found = conn.execute(FIND_TEAM, {"team_name": TEAM_NAME, "staff_email": STAFF_EMAIL}).first()
    created = found is None
    team_id = _create(conn, tickets) if found is None else uuid.UUID(str(found.id))
    count = int(conn.execute(COUNT_TICKETS, {"team_id": team_id}).scalar_one())
    users, revoked = _users(conn, token_name)
    ticket = conn.execute(
        REMINDER_TICKET, {"team_id": team_id, "staff_email": STAFF_EMAIL}
    ).scalar_one_or_none()
    reminder = None if ticket is None else uuid.UUID(str(ticket))
    return DemoTeam(team_id, created, count, users, revoked, token_name, reminder)


def describe(team: DemoTeam) -> str:
    """What ``demo-seed`` prints: the team, the users and their new tokens."""
    head = (
        f'Demo team "{TEAM_NAME}" created with {team.tickets} tickets.'
        if team.created
        else f'Demo team "{TEAM_NAME}" already seeded ({team.tickets} tickets); '
        "nothing created, new tokens issued."
    )
    lines = [head, f"team id   {team.team_id}"]
    for user in team.users:
        lines.append(f"{user.role.lower():<9} {user.email:<28} token {user.token}")
    if team.reminder_ticket is not None:
        lines.append(f"reminder  ticket {team.reminder_ticket} (open, assigned to staff)")
    lines.append("Tokens are shown only now (only their hashes are stored).")
    if team.revoked_tokens:
        lines.append(revoked_note(team))
    return "\n".join(lines)


def revoked_note(team: DemoTeam) -> str:
    """The line saying the run revoked the users' earlier tokens of the same name."""
    return (
        f'Revoked {team.revoked_tokens} earlier "{team.token_name}" token(s) of these users '
        "(they no longer work)."
    )
