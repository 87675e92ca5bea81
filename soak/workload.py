"""What the soak asks of the cluster (one plan per task) and what its users do meanwhile.

Cases (shares of ``--tasks``):

- ``export``          a valid export matching 20..200 rows, distinct filters;
- ``reminder``        a reminder due now, on its own ticket;
- ``scheduled``       a reminder due 2..20 s after its creation;
- ``invalid``         an export that must end FAILED at attempt 1 with a fixed message:
                      a row inserted with bad filters the way an old row would be, or
                      valid filters matching more than ``EXPORT_MAX_ROWS`` rows;
- ``cancel_waiting``  a reminder due in 60..120 s cancelled after a few seconds, or an
                      export cancelled right after its creation;
- ``cancel_running``  marked ``slow`` (soak/hooks.py), cancelled once seen RUNNING;
- ``fail_retry``      marked ``fail``: run 0 fails on every attempt, ends FAILED, is then
                      retried by hand (``ledger.service.retry``) and run 1 must complete.

Cases a fault creates at its own time (``by_fault``), each expected COMPLETED:

- ``long``            marked ``long``: an export of 277..300 rows that takes 52 s (26 s short),
                      a progress write every 2.2 s at most (``longterm`` SIGTERMs its
                      worker while it runs);
- ``frozen``          marked ``freeze``: a reminder whose first execution is SIGSTOPped
                      inside its transaction (``txfreeze``);
- ``behind``          two reminders of the frozen one's team, created while it is frozen:
                      they queue for the team's lock it holds.
- ``spare``           an export (20..200 rows) a ``revoke`` fault creates and revokes when
                      no run of the workload is WAITING-published or RUNNING (soak/tools.py);
                      expected CANCELLED or COMPLETED, as every revoked run.

Every task is created through :mod:`ledger.service` (except the old-style invalid rows);
the beat-driven dispatcher publishes them. Cancels and retries go through the service
too, as the task's owner, and, like every transaction of the soak's own, hold the
database gate shared (soak/gate.py) so a ``pgrestart`` never cuts one in half.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ledger import filters as F
from ledger import service
from ledger.errors import InvalidState
from soak import world as W
from soak.gate import DbGate
from tasks.export import MSG_TOO_MANY

CASE_SHARES = (
    ("export", 0.46),
    ("reminder", 0.22),
    ("scheduled", 0.10),
    ("invalid", 0.05),
    ("cancel_waiting", 0.06),
    ("cancel_running", 0.05),
    ("fail_retry", 0.06),
)

FAULT_CASES = ("long", "frozen", "behind", "spare")
BEHIND_PER_FROZEN = 2
# A long export's 52 s over at least 24 batches: a progress write every 2.2 s at most, under
# half of STALE_AFTER_S (3 s), the longest silence an execution may keep (tasks/watchdog.py
# cancels a read silent that long: ExportReadSilent, a failed attempt).
LONG_MIN_BATCHES = 24

# Tasks arrive in waves (at most WAVES, at least MIN_WAVE tasks each), so the queues hold
# a backlog at times: a Redis restart then loses queued messages, not just idle workers.
WAVES, MIN_WAVE = 20, 20

# Old-style rows the worker must reject at attempt 1, with the validator's fixed message.
INVALID_ROWS: tuple[tuple[Any, str], ...] = (
    ({"colour": "red"}, F.MSG_UNKNOWN_KEY),
    ({"status": ["DONE"]}, F.MSG_STATUS),
    ({"priority": "HIGH"}, F.MSG_PRIORITY),
    ({"q": "x" * 201}, F.MSG_Q),
    ({"created_from": "2025-03-10", "created_to": "2025-03-01"}, F.MSG_DATE_ORDER),
    ({"created_from": "1 March"}, F.MSG_DATE.format(key="created_from")),
    ({"assignee_id": 42}, F.MSG_ASSIGNEE),
    (["status"], F.MSG_NOT_OBJECT),
)

CREATE_MARKS = sa.text("""
    CREATE TABLE soak_marks (
        task_id uuid PRIMARY KEY REFERENCES background_tasks (id),
        mode text NOT NULL CHECK (mode IN ('fail', 'slow', 'freeze', 'long'))
    )
""")
INSERT_MARK = sa.text("INSERT INTO soak_marks (task_id, mode) VALUES (:task_id, :mode)")
INSERT_OLD_ROW = sa.text("""
    INSERT INTO background_tasks (kind, team_id, owner_id, scope, filters)
    VALUES ('EXPORT', :team_id, :owner_id, 'TEAM', CAST(:filters AS jsonb))
    RETURNING id
""")
READ_ROWS = sa.text("""
    SELECT id, status, run, attempts, recoveries, last_error FROM background_tasks
     WHERE id = ANY(CAST(:ids AS uuid[]))
""")


@dataclass
class TaskPlan:
    index: int
    case: str
    kind: str
    team_id: uuid.UUID
    owner_id: uuid.UUID
    scope: str = "TEAM"
    filters: Any = None
    rows: int | None = None  # exports: how many tickets match
    ticket_id: uuid.UUID | None = None  # reminders
    run_in_s: float | None = None  # reminders: due this long after creation
    mark: str | None = None  # soak_marks mode
    raw: bool = False  # inserted as an old row, not through the service
    error: str | None = None  # invalid: the fixed message expected
    cancel_after_s: float | None = None  # cancel_waiting
    submit_at_s: float = 0.0
    by_fault: bool = False  # created by a fault at its own time, not by the submitter
    # What happened to it (written by the submitter and the operator).
    task_id: uuid.UUID | None = None
    created_at: float | None = None  # time.monotonic() at creation
    create_error: str | None = None
    cancel_outcome: str | None = None  # "cancelled (<status>)" or "too late" / "never running"
    run0: dict[str, Any] | None = None  # fail_retry: the run-0 row seen before the retry
    retry_outcome: str | None = None

    def describe(self) -> str:
        return f"#{self.index} {self.case} {self.kind.lower()} {self.task_id}"


def _case_counts(total: int) -> dict[str, int]:
    counts = {case: max(1, int(total * share)) for case, share in CASE_SHARES}
    counts["export"] += total - sum(counts.values())
    return counts


def _kind(case: str, n: int) -> str:
    if case in ("export", "invalid"):
        return "EXPORT"
    if case in ("reminder", "scheduled"):
        return "REMINDER"
    return "EXPORT" if n % 2 == 0 else "REMINDER"


@dataclass(frozen=True)
class Sizes:
    tasks: int  # submitted in waves
    long: int = 0  # one per longterm fault
    frozen: int = 0  # one per txfreeze fault (and BEHIND_PER_FROZEN behind each)
    spare: int = 0  # one per revoke fault (used only when it finds no run to revoke)
    max_rows: int = 300  # EXPORT_MAX_ROWS
    batch_size: int = 12  # EXPORT_BATCH_SIZE


def build(rng: random.Random, sizes: Sizes, window_s: float) -> tuple[W.World, list[TaskPlan]]:
    """The world and one plan per task: the submitter's shuffled, in waves over
    ``window_s``; then the faults' own (``by_fault``)."""
    cases = [(case, n) for case, count in _case_counts(sizes.tasks).items() for n in range(count)]
    kinds = [_kind(case, n) for case, n in cases]
    world = W.build(
        rng,
        kinds.count("EXPORT") + sizes.long + sizes.spare,
        kinds.count("REMINDER") + sizes.frozen * (1 + BEHIND_PER_FROZEN),
    )
    seen: set[str] = set()
    plans = [
        _plan(rng, world, i, case, n, kind, seen, sizes.max_rows)
        for i, ((case, n), kind) in enumerate(zip(cases, kinds, strict=True))
    ]
    rng.shuffle(plans)
    waves = max(1, min(WAVES, len(plans) // MIN_WAVE))
    for i, plan in enumerate(plans):
        plan.index = i
        plan.submit_at_s = window_s * (i * waves // len(plans)) / waves
    plans += _fault_plans(rng, world, sizes, seen, len(plans))
    return world, plans


def _fault_plans(
    rng: random.Random, world: W.World, sizes: Sizes, seen: set[str], first: int
) -> list[TaskPlan]:
    plans: list[TaskPlan] = []
    min_rows = sizes.batch_size * (LONG_MIN_BATCHES - 1) + 1
    for n in range(sizes.long):
        team = world.export_teams[n % len(world.export_teams)]
        plan = TaskPlan(first + len(plans), "long", "EXPORT", team.id, team.staff[0], mark="long")
        plan.owner_id, plan.scope, plan.filters, plan.rows = W.long_filters(
            rng, team, seen, min_rows, sizes.max_rows
        )
        plans.append(plan)
    for n in range(sizes.frozen):
        team = world.reminder_teams[n % len(world.reminder_teams)]
        plans.append(_reminder(rng, team, first + len(plans), "frozen", mark="freeze"))
        for _ in range(BEHIND_PER_FROZEN):
            plans.append(_reminder(rng, team, first + len(plans), "behind"))
    for n in range(sizes.spare):
        team = world.export_teams[(sizes.long + n) % len(world.export_teams)]
        plan = TaskPlan(first + len(plans), "spare", "EXPORT", team.id, team.staff[0])
        plan.owner_id, plan.scope, plan.filters, plan.rows = W.export_filters(rng, team, seen)
        plans.append(plan)
    for plan in plans:
        plan.by_fault = True
    return plans


def _reminder(
    rng: random.Random, team: W.Team, index: int, case: str, mark: str | None = None
) -> TaskPlan:
    """A reminder due now on a fresh ticket of ``team``."""
    ticket = W.reminder_ticket(rng, team)
    team.tickets.append(ticket)
    plan = TaskPlan(index, case, "REMINDER", team.id, rng.choice(team.staff), ticket_id=ticket.id)
    plan.filters, plan.mark = {"ticket_id": str(ticket.id)}, mark
    return plan


def _plan(
    rng: random.Random,
    world: W.World,
    index: int,
    case: str,
    n: int,
    kind: str,
    seen: set[str],
    max_rows: int,
) -> TaskPlan:
    if kind == "REMINDER":
        team = world.reminder_teams[index % len(world.reminder_teams)]
        ticket = W.reminder_ticket(rng, team)
        team.tickets.append(ticket)
        plan = TaskPlan(index, case, kind, team.id, rng.choice(team.staff), ticket_id=ticket.id)
        plan.filters = {"ticket_id": str(ticket.id)}
        plan.run_in_s = {
            "scheduled": rng.uniform(2, 20),
            "cancel_waiting": rng.uniform(60, 120),
        }.get(case)
    else:
        team = world.export_teams[index % len(world.export_teams)]
        plan = TaskPlan(index, case, kind, team.id, team.staff[0])
        if case == "invalid":
            _invalid(plan, n, max_rows)
        else:
            plan.owner_id, plan.scope, plan.filters, plan.rows = W.export_filters(rng, team, seen)
    plan.mark = {"cancel_running": "slow", "fail_retry": "fail"}.get(case)
    if case == "cancel_waiting":
        plan.cancel_after_s = rng.uniform(0.5, 10) if kind == "REMINDER" else 0.0
    return plan


def _invalid(plan: TaskPlan, n: int, max_rows: int) -> None:
    variant = n % (len(INVALID_ROWS) + 1)
    if variant == len(INVALID_ROWS):  # valid filters, too many rows: the worker rejects it
        plan.filters, plan.error = {}, MSG_TOO_MANY.format(limit=max_rows)
        return
    plan.filters, plan.error = INVALID_ROWS[variant]
    plan.raw = True


def create(conn: Connection, plan: TaskPlan) -> uuid.UUID:
    """Insert the plan's task (and its mark) in the caller's transaction."""
    if plan.raw:
        params = {"team_id": plan.team_id, "owner_id": plan.owner_id}
        task_id = uuid.UUID(
            str(
                conn.execute(
                    INSERT_OLD_ROW, {**params, "filters": json.dumps(plan.filters)}
                ).scalar_one()
            )
        )
    elif plan.kind == "EXPORT":
        task_id = service.create_export(conn, plan.team_id, plan.owner_id, plan.scope, plan.filters)
    else:
        run_at = datetime.now(UTC) + timedelta(seconds=plan.run_in_s or 0)
        task_id = service.create_reminder(conn, plan.team_id, plan.owner_id, plan.ticket_id, run_at)
    if plan.mark:
        conn.execute(INSERT_MARK, {"task_id": task_id, "mode": plan.mark})
    return task_id


def submit(engine: sa.Engine, gate: DbGate, plan: TaskPlan) -> None:
    """Create the plan's task now (a failure is reported as a violation by the checks)."""
    try:
        with gate.shared(), engine.begin() as conn:
            plan.task_id = create(conn, plan)
        plan.created_at = time.monotonic()
    except Exception as exc:
        plan.create_error = f"{type(exc).__name__}: {exc}"


class Submitter:
    """Creates the tasks at their planned times (a fault creates its own)."""

    def __init__(self, engine: sa.Engine, gate: DbGate, plans: list[TaskPlan]) -> None:
        self.engine, self.gate = engine, gate
        self.plans = [p for p in plans if not p.by_fault]

    def run(self, stop: threading.Event) -> None:
        started = time.monotonic()
        for plan in self.plans:
            delay = plan.submit_at_s - (time.monotonic() - started)
            if delay > 0 and stop.wait(delay):
                return
            submit(self.engine, self.gate, plan)


class Operator:
    """The soak's users: they cancel and retry tasks as their cases say, through the service."""

    def __init__(self, engine: sa.Engine, gate: DbGate, plans: list[TaskPlan]) -> None:
        self.engine, self.gate = engine, gate
        self.cancel_waiting = [p for p in plans if p.case == "cancel_waiting"]
        self.cancel_running = [p for p in plans if p.case == "cancel_running"]
        self.fail_retry = [p for p in plans if p.case == "fail_retry"]
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        """Act every 50 ms until :attr:`stop` is set."""
        while not self.stop.wait(0.05):
            try:
                with self.gate.shared():
                    self.step()
            except Exception as exc:  # the soak's own connection: report, keep going
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def pending(self) -> int:
        """Decisions not yet taken (a task not created yet counts as pending)."""
        cancels = [p for p in self.cancel_waiting + self.cancel_running if p.cancel_outcome is None]
        retries = [p for p in self.fail_retry if p.run0 is None]
        return sum(1 for p in cancels + retries if p.create_error is None)

    def step(self) -> None:
        now = time.monotonic()
        for plan in self.cancel_waiting:
            if _created(plan) and plan.cancel_outcome is None:
                assert plan.created_at is not None and plan.cancel_after_s is not None
                if now >= plan.created_at + plan.cancel_after_s:
                    plan.cancel_outcome = self._cancel(plan)
        self._watch_running()
        self._watch_failed()

    def _rows(self, plans: list[TaskPlan]) -> dict[str, Any]:
        """The ledger rows of ``plans``, by task id text."""
        ids = [str(p.task_id) for p in plans]
        if not ids:
            return {}
        with self.engine.connect() as conn:
            return {str(r.id): r for r in conn.execute(READ_ROWS, {"ids": ids})}

    def _watch_running(self) -> None:
        waiting = [p for p in self.cancel_running if _created(p) and p.cancel_outcome is None]
        rows = self._rows(waiting)
        for plan in waiting:
            row = rows.get(str(plan.task_id))
            if row is None:
                continue
            if row.status == "RUNNING":
                plan.cancel_outcome = self._cancel(plan)
            elif row.status not in ("WAITING", "RUNNING"):
                plan.cancel_outcome = f"never seen running ({row.status})"

    def _watch_failed(self) -> None:
        waiting = [p for p in self.fail_retry if _created(p) and p.run0 is None]
        rows = self._rows(waiting)
        for plan in waiting:
            row = rows.get(str(plan.task_id))
            if row is None or row.status in ("WAITING", "RUNNING"):
                continue
            plan.run0 = {k: row._mapping[k] for k in ("status", "run", "attempts", "last_error")}
            if row.status == "FAILED" and row.run == 0:
                plan.retry_outcome = self._retry(plan)

    def _cancel(self, plan: TaskPlan) -> str:
        assert plan.task_id is not None
        try:
            with self.engine.begin() as conn:
                service.cancel(conn, plan.task_id, plan.owner_id)
        except InvalidState:
            return "too late"
        return "cancelled"

    def _retry(self, plan: TaskPlan) -> str:
        assert plan.task_id is not None
        with self.engine.begin() as conn:
            run = service.retry(conn, plan.task_id, plan.owner_id)
        return f"run {run}"


def _created(plan: TaskPlan) -> bool:
    return plan.task_id is not None and plan.created_at is not None
