"""P1's task bodies alone: what one small export and one reminder cost the ledger, without
Celery, the broker or a second process (``p1_body_*``).

One autocommit execution connection, as a pool child has, claims and runs ``n`` tasks of
a kind one after the other (:func:`tasks.export.run_export`,
:func:`tasks.reminder.run_reminder`: every round trip and statement of the real body).
Per task: the wall time, this process's CPU and the PostgreSQL backend's CPU (read from
``/proc``: the bench runs against a local server only). The end-to-end ratios above
move with everything else the machine runs; these figures isolate the ledger's share.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from bench.env import Part, cpu_seconds
from harness.factories import add_ticket, insert_task, make_world
from ledger import lease
from tasks.execution import Context
from tasks.export import run_export
from tasks.reminder import run_reminder
from teamdesk import db

WARM_UP = 50  # first tasks of each kind: statements prepared, caches warm; not counted
TICKETS = 20  # the reminders' team's tickets; its reminders go round them

Body = Callable[[Context], str]


def _measure(part: Part, ids: list[uuid.UUID], body: Body) -> dict[str, float]:
    engine = db.get_execution_engine()
    with engine.connect() as conn:
        pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())

        def run(task_id: uuid.UUID) -> None:
            claim = lease.claim(conn, task_id, 0)
            assert claim is not None, task_id
            body(Context(claim, part.settings, conn, engine, lambda *_: None))

        for task_id in ids[:WARM_UP]:
            run(task_id)
        timed = ids[WARM_UP:]
        server0, cpu0, wall0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
        for task_id in timed:
            run(task_id)
        wall = time.perf_counter() - wall0
        cpu, server = time.process_time() - cpu0, cpu_seconds(pid) - server0
    n = len(timed)
    return {
        "wall_us": round(wall / n * 1e6),
        "client_cpu_us": round(cpu / n * 1e6),
        "server_cpu_us": round(server / n * 1e6),
    }


def run_body_cost(part: Part, n: int) -> dict[str, Any]:
    """``n`` one-ticket exports (P1's) and ``n`` reminders (plus WARM_UP of each), each
    kind in a team of its own in ``part``'s database; every one must complete."""
    exporting, reminding = make_world(part.engine), make_world(part.engine)
    with part.engine.begin() as conn:
        add_ticket(conn, exporting.team_id, exporting.customer_id)
        tickets = [
            add_ticket(
                conn, reminding.team_id, reminding.customer_id, assignee_id=reminding.staff_id
            )
            for _ in range(TICKETS)
        ]
        exports = [insert_task(conn, exporting) for _ in range(n + WARM_UP)]
        reminders = [
            insert_task(
                conn, reminding, kind="REMINDER", filters={"ticket_id": str(tickets[i % TICKETS])}
            )
            for i in range(n + WARM_UP)
        ]
    figures = {"export": _measure(part, exports, run_export)}
    figures["reminder"] = _measure(part, reminders, run_reminder)
    with part.engine.connect() as conn:
        done = conn.execute(
            sa.text(
                "SELECT count(*) FROM background_tasks"
                " WHERE team_id IN (:e, :r) AND status = 'COMPLETED'"
            ),
            {"e": exporting.team_id, "r": reminding.team_id},
        ).scalar_one()
    assert done == 2 * (n + WARM_UP), f"{done} of {2 * (n + WARM_UP)} bodies completed"
    export, reminder = figures["export"], figures["reminder"]
    return {
        "p1_body_us_export": export["wall_us"],
        "p1_body_cpu_us_export": export["client_cpu_us"] + export["server_cpu_us"],
        "p1_body_us_reminder": reminder["wall_us"],
        "p1_body_cpu_us_reminder": reminder["client_cpu_us"] + reminder["server_cpu_us"],
        "p1_body_detail": figures,
    }
