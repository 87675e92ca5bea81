"""Faults that need to know what a process is doing, or to change its clock.

- ``skew``: a worker (or the dispatcher, every other time) is SIGTERMed and started again
  with libfaketime preloaded, 150 s ahead (or behind), for 10-30 s, then SIGTERMed and
  started on the real clock. Every threshold is the database's clock, so nothing may
  change: no lease taken from a live worker, no reminder early or late by 150 s.
- ``txfreeze``: the fault creates a reminder marked ``freeze``; its first execution lights a
  beacon inside its transaction (soak/hooks.py), and the soak SIGSTOPs that pool process
  (only it: the worker's main process keeps its heartbeat) for ``STALE_AFTER_S + 1`` ..
  ``3 x STALE_AFTER_S``, then SIGCONT. Two more reminders of the same team are created
  while it is frozen: they queue for the team's lock it holds.
- ``longterm``: the fault creates an export marked ``long`` (52 s, 26 s short: soak/hooks.py), waits
  until an execution of it has run a few seconds, and SIGTERMs the worker running it: the
  drain (``SHUTDOWN_TIMEOUT_S``) must let it finish under its lease.

Each creates its own tasks (``by_fault`` plans) at its own time, so they are checked like
every other task.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from typing import Any

import sqlalchemy as sa

from soak import beacons, workload
from soak.chaos import SKEW_S, Chaos, Record
from soak.timeline import FROZEN

SKEW_HOLD_S = (10.0, 30.0)  # how long a skewed process runs before it is set right
RESTORE_WAIT_S = 120.0  # for the skewed member to be free of other faults again
LONG_INTO_S = (1.0, 5.0)  # how far into the long export the SIGTERM lands
HOLD_OWNER_WAIT_S = 10.0

CURRENT_EXECUTION = sa.text(
    "SELECT status, left(CAST(execution_id AS text), 8) AS execution "
    "FROM background_tasks WHERE id = :id"
)


# ---- skew ---------------------------------------------------------------------------------
def skew(chaos: Chaos, record: Record) -> None:
    name = record.target or "beat"  # a worker's name once the injector took one
    if name == "beat" and not _hold(chaos, "beat", HOLD_OWNER_WAIT_S):
        record.detail = "skipped: beat is held by another fault"
        return
    offset = record.sign * SKEW_S
    hold_s = round(record.rng.uniform(*SKEW_HOLD_S), 1)
    record.target = name
    record.detail = f"faketime {offset:+d}s for {hold_s}s"
    chaos.later(_skewed, chaos, record, name, offset, hold_s)


def _hold(chaos: Chaos, name: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if chaos.cluster.hold(name) is not None:
            return True
        time.sleep(0.2)
    return False


def _skewed(chaos: Chaos, record: Record, name: str, offset: int, hold_s: float) -> None:
    member = chaos.cluster.members[name]
    member.skew_s = offset
    chaos.cluster.terminate(name, "skew")
    chaos.cluster.release(name, restart=True)
    skewed = member.current.name if member.current else "?"
    time.sleep(hold_s)
    member.skew_s = 0
    if not _hold(chaos, name, RESTORE_WAIT_S):
        record.detail += f" ({skewed}); not set right: the member stayed held"
        return
    chaos.cluster.terminate(name, "skew")
    chaos.cluster.release(name, restart=True)
    record.detail += f" ({skewed}), then {member.current.name if member.current else '?'}"


# ---- txfreeze -----------------------------------------------------------------------------
def txfreeze(chaos: Chaos, record: Record) -> None:
    supply = chaos.supply.get("frozen", [])
    if not supply:
        record.detail = "skipped: no reminder planned for it"
        return
    plan = supply.pop(0)
    behind = [p for p in chaos.supply.get("behind", []) if p.team_id == plan.team_id]
    behind = behind[: workload.BEHIND_PER_FROZEN]
    for other in behind:
        chaos.supply["behind"].remove(other)
    stale = chaos.timings.stale_after_s
    frozen_s = round(record.rng.uniform(stale + 1.0, 3 * stale), 1)
    workload.submit(chaos.engine, chaos.gate, plan)
    record.detail = f"reminder {str(plan.task_id)[:8]}"
    chaos.later(_freeze, chaos, record, plan, behind, frozen_s)


def _freeze(
    chaos: Chaos,
    record: Record,
    plan: workload.TaskPlan,
    behind: list[workload.TaskPlan],
    frozen_s: float,
) -> None:
    beacon = beacons.wait(chaos.beacon_dir, f"freeze-{plan.task_id}", chaos.timings.task_wait_s)
    if beacon is None:
        record.detail = f"skipped: {record.detail} never reached its transaction"
        return
    pid = int(beacon["pid"])
    name = chaos.cluster.owner_of(pid)
    if name is None or chaos.cluster.hold(name) is None:
        record.detail = f"skipped: {record.detail}: its worker is down or held by another fault"
        return
    inc = chaos.cluster.members[name].current
    assert inc is not None
    window = chaos.timeline.open(f"{inc.name}/{pid}", FROZEN, "txfreeze", note=str(plan.team_id))
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for other in behind:
        workload.submit(chaos.engine, chaos.gate, other)
    record.target = name
    record.detail += (
        f" in {inc.name} pool pid {pid}: SIGSTOP inside its transaction for {frozen_s}s, "
        f"{len(behind)} reminders of its team behind it"
    )
    time.sleep(frozen_s)
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    chaos.timeline.close(window)
    chaos.cluster.release(name, restart=False)


# ---- longterm -----------------------------------------------------------------------------
def longterm(chaos: Chaos, record: Record) -> None:
    supply = chaos.supply.get("long", [])
    if not supply:
        record.detail = "skipped: no long export planned for it"
        return
    plan = supply.pop(0)
    into_s = round(record.rng.uniform(*LONG_INTO_S), 1)
    workload.submit(chaos.engine, chaos.gate, plan)
    record.detail = f"export {str(plan.task_id)[:8]} ({plan.rows} rows)"
    chaos.later(_term_during_export, chaos, record, plan, into_s)


def _running_execution(chaos: Chaos, plan: workload.TaskPlan) -> dict[str, Any] | None:
    """The beacon of the export's current execution, once it has one (None: not running)."""
    try:
        with chaos.gate.shared(), chaos.engine.connect() as conn:
            row = conn.execute(CURRENT_EXECUTION, {"id": plan.task_id}).one()
    except sa.exc.DBAPIError:
        return None
    if row.status != "RUNNING" or row.execution is None:
        return None
    return beacons.read(chaos.beacon_dir, f"long-{plan.task_id}-{row.execution}")


def _term_during_export(
    chaos: Chaos, record: Record, plan: workload.TaskPlan, into_s: float
) -> None:
    deadline = time.monotonic() + chaos.timings.task_wait_s
    while time.monotonic() < deadline:
        beacon = _running_execution(chaos, plan)
        if beacon is None:
            time.sleep(0.2)
            continue
        with chaos.shield():
            time.sleep(into_s)
            name = _hold_runner(chaos, plan, beacon)
            if name is not None:
                _drain(chaos, record, name, into_s)
                return
    record.detail = f"skipped: {record.detail}: no execution to interrupt"


def _hold_runner(chaos: Chaos, plan: workload.TaskPlan, beacon: dict[str, Any]) -> str | None:
    """Hold the member whose current process runs the beacon's execution (None: it ended,
    or its worker is held by another fault or was restarted meanwhile)."""
    pid = int(beacon["pid"])
    name = chaos.cluster.owner_of(pid)
    if name is None or not _hold(chaos, name, HOLD_OWNER_WAIT_S):
        return None
    if chaos.cluster.owner_of(pid) != name or _running_execution(chaos, plan) != beacon:
        chaos.cluster.release(name, restart=False)  # it moved on while we waited
        return None
    return name


def _drain(chaos: Chaos, record: Record, name: str, into_s: float) -> None:
    started = time.monotonic()
    inc = chaos.cluster.terminate(name, "longterm")
    chaos.term_exit_codes.append(inc.exit_code)
    chaos.cluster.release(name, restart=True)
    record.target = name
    record.detail += (
        f": SIGTERM {inc.name} {into_s}s into it, exit {inc.exit_code} after "
        f"{time.monotonic() - started:.1f}s"
    )
