"""The soak's business data: teams, members and tickets, generated from the seed.

Export teams hold ``TICKETS_PER_TEAM`` tickets spread over ``DAYS`` days with every
field varied (statuses, priorities, NULL assignees and due dates, titles that need CSV
quoting or the formula guard, equal timestamps). Their tickets are never modified
during the soak, so an export's CSV can be recomputed at the end. Reminder teams hold
one ticket per reminder (reminders bump their ticket), so no export ever reads them.

Ids are drawn from the seed too, so a seed describes the same world every time.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from harness.csv_reference import matches

TICKETS_PER_TEAM = 400
DAYS = 40
BASE_DAY = date(2025, 3, 1)
EXPORTS_PER_TEAM = 25
MIN_ROWS, MAX_ROWS = 20, 200
STATUSES = ("OPEN", "PENDING", "RESOLVED", "CLOSED")
PRIORITIES = ("LOW", "NORMAL", "HIGH", "URGENT")
TOKENS = ("printer", "login", "billing", "refund", "crash", "email", "vpn", "invoice")
TITLES = (
    "{Token} issue #{n}",
    '=HYPERLINK("{token}")',
    "+{n} {token} call back",
    "-{token}- urgent",
    "@{token} team, please check",
    '{token}, "quoted" and, commas',
    "{token}\nsecond line",
    "Ünïcödé {token} ✓ #{n}",
    "{token}\r\nwindows line",
    "\t=cmd|' /C {token}'!A0",
    '\r=HYPERLINK("{token}")',
    "plain {token} {n}",
)


def seeded_uuid(rng: random.Random) -> uuid.UUID:
    return uuid.UUID(int=rng.getrandbits(128), version=4)


@dataclass(frozen=True)
class Ticket:
    id: uuid.UUID
    title: str
    status: str
    priority: str
    requester_id: uuid.UUID
    assignee_id: uuid.UUID | None
    due_at: datetime | None
    created_at: datetime
    updated_at: datetime


@dataclass
class Team:
    id: uuid.UUID
    staff: list[uuid.UUID]
    customers: list[uuid.UUID]
    tickets: list[Ticket] = field(default_factory=list)

    @property
    def members(self) -> list[uuid.UUID]:
        return self.staff + self.customers


@dataclass
class World:
    export_teams: list[Team]
    reminder_teams: list[Team]


def _title(rng: random.Random, token: str) -> str:
    if rng.random() < 0.01:
        return ""
    pattern = rng.choice(TITLES)
    return pattern.format(token=token, Token=token.upper(), n=rng.randint(1, 9999))


def _ticket(rng: random.Random, team: Team, created_at: datetime) -> Ticket:
    assignee = rng.choice(team.staff) if rng.random() < 0.85 else None
    due = created_at + timedelta(days=rng.randint(1, 20)) if rng.random() < 0.5 else None
    return Ticket(
        id=seeded_uuid(rng),
        title=_title(rng, rng.choice(TOKENS)),
        status=rng.choices(STATUSES, weights=(40, 25, 20, 15))[0],
        priority=rng.choices(PRIORITIES, weights=(20, 45, 25, 10))[0],
        requester_id=rng.choice(team.members),
        assignee_id=assignee,
        due_at=due,
        created_at=created_at,
        updated_at=created_at + timedelta(minutes=rng.randint(0, 5000)),
    )


def _export_tickets(rng: random.Random, team: Team) -> list[Ticket]:
    tickets: list[Ticket] = []
    start = datetime.combine(BASE_DAY, datetime.min.time(), tzinfo=UTC)
    for _ in range(TICKETS_PER_TEAM):
        if tickets and rng.random() < 0.03:
            created = tickets[-1].created_at  # equal timestamps: ordered by id
        else:
            created = start + timedelta(
                days=rng.randrange(DAYS),
                seconds=rng.randrange(86400),
                microseconds=rng.randrange(1_000_000),
            )
        tickets.append(_ticket(rng, team, created))
    return tickets


def _team(rng: random.Random, staff: int, customers: int) -> Team:
    return Team(
        id=seeded_uuid(rng),
        staff=[seeded_uuid(rng) for _ in range(staff)],
        customers=[seeded_uuid(rng) for _ in range(customers)],
    )


def build(rng: random.Random, export_tasks: int, reminder_tasks: int) -> World:
    export_teams = [_team(rng, 3, 3) for _ in range(max(2, -(-export_tasks // EXPORTS_PER_TEAM)))]
    for team in export_teams:
        team.tickets = _export_tickets(rng, team)
    reminder_teams = [_team(rng, 3, 2) for _ in range(max(2, min(12, reminder_tasks // 40)))]
    return World(export_teams, reminder_teams)


def reminder_ticket(rng: random.Random, team: Team) -> Ticket:
    """A fresh OPEN ticket with a staff assignee (a reminder on it must notify)."""
    now = datetime.now(UTC).replace(microsecond=0)
    ticket = _ticket(rng, team, now - timedelta(days=1))
    return replace(ticket, status="OPEN", assignee_id=rng.choice(team.staff))


INSERT_TEAM = sa.text("INSERT INTO teams (id, name) VALUES (:id, :name)")
INSERT_USER = sa.text("INSERT INTO users (id, email, name) VALUES (:id, :email, :name)")
INSERT_MEMBER = sa.text(
    "INSERT INTO memberships (team_id, user_id, role) VALUES (:team_id, :user_id, :role)"
)
INSERT_TICKET = sa.text("""
    INSERT INTO tickets (id, team_id, title, status, priority, requester_id, assignee_id,
                         due_at, created_at, updated_at)
    VALUES (:id, :team_id, :title, :status, :priority, :requester_id, :assignee_id,
            :due_at, :created_at, :updated_at)
""")


def ticket_params(team: Team, ticket: Ticket) -> dict[str, Any]:
    return {**asdict(ticket), "team_id": team.id}


def insert(conn: Connection, world: World) -> None:
    for n, team in enumerate(world.export_teams + world.reminder_teams):
        conn.execute(INSERT_TEAM, {"id": team.id, "name": f"Soak team {n}"})
        for role, users in (("STAFF", team.staff), ("CUSTOMER", team.customers)):
            for user in users:
                email = f"{user.hex[:12]}@soak.test"
                conn.execute(INSERT_USER, {"id": user, "email": email, "name": role.title()})
                conn.execute(INSERT_MEMBER, {"team_id": team.id, "user_id": user, "role": role})
        if team.tickets:
            conn.execute(INSERT_TICKET, [ticket_params(team, t) for t in team.tickets])


# ---- export filters with a known number of matching rows ----------------------------------


def _random_filters(rng: random.Random, team: Team) -> tuple[uuid.UUID, str, dict[str, Any]]:
    scope = "TEAM" if rng.random() < 0.7 else "MINE"
    owner = rng.choice(team.staff if scope == "TEAM" else team.members)
    filters: dict[str, Any] = {}
    first = rng.randrange(DAYS)
    span = rng.randint(1, 30)
    if rng.random() < 0.9:
        filters["created_from"] = (BASE_DAY + timedelta(days=first)).isoformat()
    if rng.random() < 0.9:
        filters["created_to"] = (BASE_DAY + timedelta(days=first + span - 1)).isoformat()
    if rng.random() < 0.4:
        filters["status"] = rng.sample(STATUSES, rng.randint(1, 3))
    if rng.random() < 0.3:
        filters["priority"] = rng.sample(PRIORITIES, rng.randint(1, 3))
    if rng.random() < 0.1:
        filters["assignee_id"] = str(rng.choice(team.staff))
    if rng.random() < 0.25:
        token = rng.choice(TOKENS)
        filters["q"] = token.upper() if rng.random() < 0.3 else token
    return owner, scope, filters


def _key(team: Team, owner: uuid.UUID, scope: str, filters: dict[str, Any]) -> str:
    return json.dumps([str(team.id), str(owner), scope, filters], sort_keys=True)


def export_filters(
    rng: random.Random, team: Team, seen: set[str]
) -> tuple[uuid.UUID, str, dict[str, Any], int]:
    """Distinct (owner, scope, filters) for ``team`` matching MIN_ROWS..MAX_ROWS tickets."""
    for _ in range(10_000):
        owner, scope, filters = _random_filters(rng, team)
        key = _key(team, owner, scope, filters)
        if key in seen:
            continue
        rows = sum(1 for t in team.tickets if matches(t, owner, scope, filters))
        if MIN_ROWS <= rows <= MAX_ROWS:
            seen.add(key)
            return owner, scope, filters, rows
    raise RuntimeError("soak: could not draw export filters in range")


def long_filters(
    rng: random.Random, team: Team, seen: set[str], min_rows: int, max_rows: int
) -> tuple[uuid.UUID, str, dict[str, Any], int]:
    """A TEAM export of ``team`` over a window of days matching min_rows..max_rows tickets
    (the ``longterm`` fault's long export needs many batches)."""
    owner = team.staff[0]
    windows = [(a, b) for a in range(DAYS) for b in range(a, DAYS)]
    rng.shuffle(windows)
    for first, last in windows:
        filters = {
            "created_from": (BASE_DAY + timedelta(days=first)).isoformat(),
            "created_to": (BASE_DAY + timedelta(days=last)).isoformat(),
        }
        key = _key(team, owner, "TEAM", filters)
        rows = sum(1 for t in team.tickets if matches(t, owner, "TEAM", filters))
        if key not in seen and min_rows <= rows <= max_rows:
            seen.add(key)
            return owner, "TEAM", filters, rows
    raise RuntimeError("soak: no window of days matches a long export's rows")
