"""``poolkill``: SIGKILL of one pool process of a live worker while it runs a task (the OOM
killer, ``kill -9`` of a prefork child), the worker's main process living on.

The worker's main process must make that the run's failed attempt within about a second
(worker/lost.py, ``ledger.lease.report_lost``): the row WAITING and unpublished, due after
the backoff, or FAILED on the last attempt, with the reason; a WAIT or FAIL audit row
carrying the lost execution's id; one ``task.process_lost`` line; never a recovery.

The fault picks real work, not an idle process. It watches the workers' logs as they grow
(:class:`soak.logscan.LogTail`: ``task.started`` names each execution's pool pid, a closing
event from that pid ends it) and the ledger's RUNNING rows of the runs it may hit: runs 0
of the ``export``, ``reminder`` and ``scheduled`` cases (and its own ``spare`` export),
never one a ``revoke`` named (those keep their own expectations), and never a run whose
process it already killed ``MAX_TASK_ATTEMPTS - 1`` times, so no run ends FAILED by this
fault alone. A candidate is a pool process that psutil lists among its worker's main
process's children and whose current execution the ledger shows holding its run. The
fault holds that worker (no other worker fault meanwhile), SIGSTOPs the process, checks
again - the row still RUNNING under that very execution, the log still showing it
unfinished - and only then SIGKILLs it (else SIGCONT and looks again): a process stopped
cannot finish its execution or start the next one in between, so the kill always lands
on the execution it names. When nothing is found for ``PICK_WAIT_S`` (the end of the
window: the workload has drained; or faults kept every worker busy or held) it creates a
``spare`` export marked ``slow`` (a 2 s pause at its first batch, soak/hooks.py) and
kills its process once it runs - or any other run's that comes to run first (up to the
fault's task wait: its export may queue behind a backlog).

The timeline gets a ``dead`` window on ``w2.3/<pid>`` (and the ``frozen`` moment before
it). The fault then waits, still holding the worker, for the main process's
``task.process_lost`` line (up to ``REPORT_WAIT_S``) and looks at the row once: after a
``retry`` it must say the lost-process reason, and be due the backoff after the WAIT.
soak/checks.py judges the rest from the logs and the audit trail.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from soak import logscan, workload
from soak.chaos import Chaos, PoolKill, Record
from soak.cluster import Incarnation
from soak.timeline import FROZEN
from worker.lost import MSG_LOST, MSG_LOST_FINAL

KILLABLE_CASES = ("export", "reminder", "scheduled", "spare")
PICK_WAIT_S = 10.0  # for a run of the workload to be running in a pool process
PICK_POLL_S = 0.05
REPORT_WAIT_S = 15.0  # holding the worker, for its main process's task.process_lost line
REPORT_POLL_S = 0.1
HOW = "signal 9 (SIGKILL)"  # billiard's words for the exit, in the reason
BACKOFF_SLACK_S = 0.25  # run_at vs the WAIT's audit time (now() vs clock_timestamp())

RUNNING = sa.text("""
    SELECT id, run, attempts, CAST(execution_id AS text) AS execution
      FROM background_tasks
     WHERE id = ANY(CAST(:ids AS uuid[])) AND run = 0 AND status = 'RUNNING'
       AND execution_id IS NOT NULL
""")
HOLDER = sa.text("""
    SELECT status, run, attempts, CAST(execution_id AS text) AS execution
      FROM background_tasks WHERE id = :id
""")
AFTER_REPORT = sa.text("""
    SELECT b.status, b.attempts, b.last_error, extract(epoch FROM b.run_at) AS run_at,
           (SELECT extract(epoch FROM a.at) FROM task_audit a
             WHERE a.task_id = b.id AND a.execution_id = CAST(:execution AS uuid)
               AND a.event IN ('WAIT', 'FAIL') ORDER BY a.id DESC LIMIT 1) AS reported_at
      FROM background_tasks b WHERE b.id = :id
""")

_tails: dict[Path, logscan.LogTail] = {}


def _tail(inc: Incarnation) -> logscan.LogTail:
    found = _tails.get(inc.log)
    if found is None:
        found = _tails.setdefault(inc.log, logscan.LogTail(inc.log))
    found.read()
    return found


@dataclass(frozen=True)
class Target:
    member: str  # w1..w3
    inc: Incarnation
    pid: int  # the pool process
    plan: workload.TaskPlan
    execution: str  # the row's execution id
    attempt: int


def poolkill(chaos: Chaos, record: Record) -> None:
    record.detail = "SIGKILL of a pool process running a task"
    chaos.later(_poolkill, chaos, record)


def _poolkill(chaos: Chaos, record: Record) -> None:
    if _kill_one(chaos, record, PICK_WAIT_S):
        return
    supply = chaos.supply.get("spare", [])
    if not supply:
        record.detail = "skipped: no run of the workload running, and no spare export left"
        return
    plan = supply.pop(0)
    plan.mark = "slow"  # a 2 s pause at its first batch: it surely runs for a while
    workload.submit(chaos.engine, chaos.gate, plan)
    # Its own export, or any other run that comes to run meanwhile.
    wait_s = chaos.timings.task_wait_s
    if plan.task_id is None or not _kill_one(chaos, record, wait_s):
        own = str(plan.task_id)[:8] if plan.task_id else f"not created: {plan.create_error}"
        record.detail = (
            f"skipped: no run running in a free worker for {PICK_WAIT_S:.0f}s, nor in the "
            f"{wait_s:.0f}s after it created its own slow export ({own})"
        )
        return
    if str(plan.task_id)[:8] in record.detail:
        record.detail += " (the fault's own slow export)"


def _revoked(chaos: Chaos) -> set[uuid.UUID]:
    """The runs a ``revoke`` fault named or is about to name (they keep its expectations)."""
    with chaos.revoke_lock:
        return {r.task_id for r in chaos.revokes} | chaos.revoke_picked


def _killable(chaos: Chaos) -> list[workload.TaskPlan]:
    """The runs it may hit, as of now (tasks are created all along)."""
    revoked = _revoked(chaos)
    return [
        p
        for p in chaos.plans
        if p.case in KILLABLE_CASES and p.task_id is not None and p.task_id not in revoked
    ]


def _kill_one(chaos: Chaos, record: Record, wait_s: float) -> bool:
    """Kill the pool process of one running execution it may hit (up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        targets = _targets(chaos, _killable(chaos))
        if targets:
            target = targets[record.rng.randrange(len(targets))]
            if _kill(chaos, record, target):
                return True
        time.sleep(PICK_POLL_S)
    return False


def _targets(chaos: Chaos, plans: list[workload.TaskPlan]) -> list[Target]:
    """Pool processes of free workers running an execution that holds one of ``plans``'
    runs (and whose run may lose one more attempt to this fault)."""
    revoked = _revoked(chaos)
    spent = chaos.timings.max_attempts - 1
    kills = Counter(k.task_id for k in chaos.pool_kills)
    by_id = {
        p.task_id: p
        for p in plans
        if p.task_id is not None and p.task_id not in revoked and kills[p.task_id] < spent
    }
    if not by_id:
        return []
    try:
        with chaos.engine.connect() as conn:
            rows = list(conn.execute(RUNNING, {"ids": [str(i) for i in by_id]}))
    except sa.exc.DBAPIError:
        return []  # PostgreSQL restarting or squeezed: look again
    if not rows:
        return []
    targets = []
    for name in chaos.cluster.worker_names:
        member = chaos.cluster.members[name]
        inc = member.current
        if inc is None or member.held or not member.running:
            continue
        children = _children(inc)
        running = {v: pid for pid, v in _tail(inc).running.items() if pid in children}
        for row in rows:
            pid = running.get((str(row.id), row.execution[:8]))
            if pid is not None:
                targets.append(
                    Target(name, inc, pid, by_id[row.id], row.execution, int(row.attempts))
                )
    return targets


def _children(inc: Incarnation) -> set[int]:
    """The pool processes of the worker (its main process's children), by psutil."""
    try:
        return {child.pid for child in psutil.Process(inc.main_pid).children()}
    except psutil.Error:
        return set()


def _kill(chaos: Chaos, record: Record, target: Target) -> bool:
    """Hold the worker, stop the pool process, check it still runs the execution that
    holds the run, kill it; then wait for the report. False when it had moved on."""
    if chaos.cluster.hold(target.member) is None:
        return False
    try:
        if chaos.cluster.members[target.member].current is not target.inc:
            return False
        if target.pid not in _children(target.inc):
            return False
        killed = _stop_check_kill(chaos, target)
        if killed is None:
            return False
        chaos.pool_kills.append(killed)
        record.target = target.member
        what = "export" if target.plan.kind == "EXPORT" else "reminder"
        record.detail = (
            f"{target.inc.name} pool pid {target.pid} running {what} "
            f"{str(target.plan.task_id)[:8]}-{killed.run} ({target.plan.case}, execution "
            f"{target.execution[:8]}, attempt {target.attempt}): SIGKILL"
        )
        _await_report(chaos, target.inc, killed)
        record.detail += f"; {killed.seen}"
        return True
    finally:
        chaos.cluster.release(target.member, restart=False)


def _stop_check_kill(chaos: Chaos, target: Target) -> PoolKill | None:
    process = f"{target.inc.name}/{target.pid}"
    tail = _tail(target.inc)
    assert target.plan.task_id is not None
    key = (str(target.plan.task_id), target.execution[:8])
    try:
        # The connection first: none is opened while the process is stopped (a squeeze
        # would keep it stopped for seconds).
        with chaos.gate.shared(), chaos.engine.connect() as conn:
            window = chaos.timeline.open(process, FROZEN, "poolkill")
            killed = False
            try:
                try:
                    os.kill(target.pid, signal.SIGSTOP)
                except ProcessLookupError:
                    return None
                tail.read()  # everything it logged before it stopped
                row = conn.execute(HOLDER, {"id": target.plan.task_id}).one()
                held = (row.status, row.execution) == ("RUNNING", target.execution)
                if not held or tail.running.get(target.pid) != key:
                    return None
                chaos.timeline.dead(process, "poolkill")
                at = chaos.timeline.now()
                os.kill(target.pid, signal.SIGKILL)
                killed = True
                tail.running.pop(target.pid, None)
                return PoolKill(
                    target.plan.task_id,
                    int(row.run),
                    target.plan.case,
                    target.execution,
                    int(row.attempts),
                    target.inc.name,
                    target.pid,
                    target.inc.main_pid,
                    at,
                )
            finally:
                if not killed:  # it moved on, or the database did not answer: let it go on
                    with suppress(ProcessLookupError):
                        os.kill(target.pid, signal.SIGCONT)
                chaos.timeline.close(window)
    except sa.exc.DBAPIError:
        return None  # PostgreSQL away: the process goes on (SIGCONT above)


def _await_report(chaos: Chaos, inc: Incarnation, killed: PoolKill) -> None:
    """Wait for the main process's ``task.process_lost`` about the killed process; then
    look at the row once (while it has not moved on)."""
    started = time.monotonic()
    report: dict[str, Any] | None = None
    while time.monotonic() - started < REPORT_WAIT_S:
        report = _tail(inc).lost.get(killed.pid)
        if report is not None:
            break
        time.sleep(REPORT_POLL_S)
    if report is None:
        killed.seen = f"no task.process_lost within {REPORT_WAIT_S:.0f}s"
        return
    outcome = str(report.get("outcome"))
    killed.seen = f"reported {outcome} after {time.monotonic() - started:.1f}s"
    if outcome in ("retry", "failed"):
        killed.seen += f" (attempt {report.get('attempt')})"
        _look_at_row(chaos, killed, outcome)


def _look_at_row(chaos: Chaos, killed: PoolKill, outcome: str) -> None:
    """Right after a retry (or failed) report the row says why, and a retry is due the
    backoff after its WAIT; once the run went on (completed, failed again) nothing is
    left to see."""
    try:
        with chaos.engine.connect() as conn:
            row = conn.execute(
                AFTER_REPORT, {"id": killed.task_id, "execution": killed.execution}
            ).one()
    except sa.exc.DBAPIError:
        return
    timings = chaos.timings
    how = f"pid {killed.pid}, {HOW}"
    problems = []
    if outcome == "failed":
        want = MSG_LOST_FINAL.format(n=timings.max_attempts, how=how)
        if (row.status, row.last_error) != ("FAILED", want):
            problems.append(f"{row.status}, last_error {row.last_error!r} (expected {want!r})")
    elif (row.status, row.attempts) in (
        ("WAITING", killed.attempt),
        ("RUNNING", killed.attempt + 1),
    ):
        want = MSG_LOST.format(how=how)
        if row.last_error != want:
            problems.append(f"last_error {row.last_error!r} (expected {want!r})")
        backoff = timings.retry_base_delay_s * 2 ** max(killed.attempt - 1, 0)
        if row.reported_at is None:
            problems.append("no WAIT audit row by the lost execution")
        elif abs(float(row.run_at) - float(row.reported_at) - backoff) > BACKOFF_SLACK_S:
            due = float(row.run_at) - float(row.reported_at)
            problems.append(f"due {due:.2f}s after its WAIT (expected the backoff {backoff:g}s)")
    else:
        return
    if problems:
        killed.row_problem = "; ".join(problems)
