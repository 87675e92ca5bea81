"""The soak's verdict, read from PostgreSQL alone once the cluster is quiet.

Per task: the end state its case expects (see soak/workload.py), the fixed messages,
the reminder side effects (exactly one notification, one ``ticket.reminder_sent`` event
and one version bump for a COMPLETED reminder, none otherwise) and the export CSV
(equal to ``harness.csv_reference.expected_csv``, computed independently from the
tickets table). Globally: nothing WAITING or RUNNING, no commit by a replaced execution
(``ledger.audit``), no task completed twice, no side effect without its task, the
exported tickets unchanged, no lease taken from a live execution and no CLAIM over a
live, unfrozen holder (soak/leases.py), and no process exit the soak did not cause.

Celery's command line (soak/tools.py): a run the ``revoke`` fault named must end CANCELLED
(by the revoke: its CANCEL is after the command started) or COMPLETED, and one still
WAITING or RUNNING at the end is a run that never ends (``revoke-never-ended``); a run
whose message ``purge`` took must be going again (re-published, claimed or ended) within
``PURGE_GOAL_S`` of the purge (``purge-stalled``): the dispatcher's looks at the broker
find the message missing within two scans, long before LOST_AFTER.

A run that ends FAILED after its last attempt where each failed attempt (its CLAIM ..
WAIT/FAIL in the audit trail) spans a fault that cut the workers' database connections or
refused new ones (``pgkill``, ``pgrestart``, ``pgsqueeze``), or lost its pool process
(its WAIT/FAIL is its worker's ``task.process_lost`` report), did what the attempt budget
is for: it is counted, not a violation - provided its ``last_error`` is the one its last
attempt calls for (the lost-process reason naming that pid and signal when that attempt
lost its process, else "failed after N attempts"). Any other failed end of a case that
expects COMPLETED is (a run FAILED with "stopped responding too many times" included: its
recoveries were false ones). The ``poolkill`` fault never kills one run's process more
than ``MAX_TASK_ATTEMPTS - 1`` times, so only a mix of faults can use a budget up.

The lost-process rule (``poolkill``, soak/poolkill.py): each pool process the soak killed
while it ran an execution holding its run must be reported by its worker's main process
(``task.process_lost``, logged with the main process's pid, naming that execution and
``signal 9 (SIGKILL)``): ``retry`` or ``failed`` with the WAIT or FAIL audit row by that
execution directly after its CLAIM, within ``LOST_REPORT_GOAL_S`` of the kill, the
attempt it names the one that was lost; ``not_held`` only when the execution's own write
(or a cancel) came first; ``unreported`` only while a database fault kept new
connections away. Never a RECOVER or a takeover of that execution instead (a report
delayed by a fault that stalled the worker's event loop or the database is excused and
counted). Violations: ``process-lost-unreported``, ``process-lost-report``,
``process-lost-slow``, ``process-lost-recovered``, ``process-lost-row`` (the row right
after a retry report did not give the reason or the backoff).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from harness.csv_reference import expected_csv
from ledger import audit
from ledger.lease import MSG_TOO_MANY_RECOVERIES
from soak import leases
from soak.chaos import PoolKill, Purge, Revoke
from soak.cluster import Incarnation
from soak.leases import LeaseJudge
from soak.logscan import ProcessLost
from soak.tools import PURGE_GOAL_S, PURGE_WATCH_S
from soak.workload import TaskPlan
from tasks.execution import MSG_EXHAUSTED
from tasks.reminder import EVENT_TYPE
from worker.lost import MSG_LOST_FINAL

# result_csv: the stored CSV, from the chunks the completion names (ledger/artifacts.py).
TASKS = sa.text("""
    SELECT id, kind, status, run, attempts, progress, recoveries, last_error,
           (SELECT convert_from(string_agg(c.data, ''::bytea ORDER BY c.seq), 'UTF8')
              FROM export_chunks c
             WHERE c.task_id = t.id AND c.execution_id = t.result_key) AS result_csv,
           result_summary, team_id, owner_id, scope, filters
      FROM background_tasks t
""")
NOTIFICATIONS = sa.text(
    "SELECT task_id, ticket_id, user_id, count(*) AS n FROM notifications "
    "GROUP BY task_id, ticket_id, user_id"
)
EVENTS = sa.text("SELECT ticket_id, type, payload->>'task_id' AS task_id FROM system_events")
VERSIONS = sa.text(
    "SELECT id, version, assignee_id FROM tickets WHERE team_id = ANY(CAST(:teams AS uuid[]))"
)
FINGERPRINT = sa.text("""
    SELECT count(*) AS n, md5(string_agg(t::text, '|' ORDER BY t.id)) AS digest
      FROM tickets t WHERE team_id = ANY(CAST(:teams AS uuid[]))
""")
AUDIT_TRAIL = sa.text("""
    SELECT id, run, event, execution_id, at FROM task_audit WHERE task_id = :task_id ORDER BY id
""")
AUDIT_COUNTS = sa.text("SELECT event, count(*) AS n FROM task_audit GROUP BY event")
# Each failed attempt of a run: from its execution's CLAIM to its WAIT or FAIL.
FAILED_ATTEMPTS = sa.text("""
    SELECT extract(epoch FROM c.at) AS claimed, extract(epoch FROM e.at) AS ended,
           e.event, CAST(e.execution_id AS text) AS execution
      FROM task_audit e
      JOIN task_audit c ON c.task_id = e.task_id AND c.execution_id = e.execution_id
                       AND c.event = 'CLAIM'
     WHERE e.task_id = :task_id AND e.run = :run AND e.event IN ('WAIT', 'FAIL')
""")
CANCELS = sa.text("""
    SELECT task_id, count(*) AS n, min(extract(epoch FROM at)) AS first
      FROM task_audit WHERE event = 'CANCEL' AND task_id = ANY(CAST(:ids AS uuid[]))
     GROUP BY task_id
""")
DATABASE_FAULTS = ("pgkill", "pgrestart", "pgsqueeze")
# Faults during which no worker takes messages, each with the time the workers need after
# it to consume again: after a failover or a Redis restart Celery's consumers reconnect on
# their own backoff (retries 2, 4, 6 s apart); after a squeeze or a PostgreSQL restart the
# next liveness tick (0.75 s) resumes intake. A purge's clock stops meanwhile.
INTAKE_FAULTS = {"failover": 6.0, "redis": 6.0, "pgsqueeze": 1.0, "pgrestart": 1.0}
REVOKED_ENDS = (("CANCELLED", 0), ("COMPLETED", 0))
# A run's audit trail (the lost-process rule): each row's time on the database's clock.
RUN_TRAIL = sa.text("""
    SELECT id, event, CAST(execution_id AS text) AS execution, extract(epoch FROM at) AS at
      FROM task_audit WHERE task_id = :task_id AND run = :run ORDER BY id
""")
# The lost-process rule: a killed pool process's attempt is written within this of the
# kill. The worker's main process looks at its pool every 0.5 s (worker/lost.py,
# POOL_LOOK_S) and writes at once; it gives up after half of STALE_AFTER_S (3 s) of a
# database that does not answer. 3 s is that same bound: the staleness rule (6 s of
# silence) must never be the one to take a lost process's run back.
LOST_REPORT_GOAL_S = 3.0
# Faults that may hold a report up, each with the time it takes to recover after it: a
# database refusing new connections (the report's connection is new each time; past half
# of STALE_AFTER_S it is "unreported") and a Redis outage (the worker's main process
# watches its pool on its event loop, which does not run while its consumer reconnects:
# retries 2, 4, 6 s apart).
LOST_DELAY_FAULTS = {"pgrestart": 1.0, "pgsqueeze": 1.0, "redis": 6.0, "failover": 6.0}
LOST_UNREPORTED_FAULTS = {"pgrestart": 1.0, "pgsqueeze": 1.0}
OWN_ENDS = ("COMPLETE", "WAIT", "FAIL")


@dataclass(frozen=True)
class Violation:
    what: str
    task: str
    detail: str
    task_id: uuid.UUID | None = None

    def line(self) -> str:
        task = "" if self.task == "-" else f"{self.task} "
        return f"  VIOLATION {self.what}: {task}{self.detail}".rstrip()


def fingerprint(engine: sa.Engine, teams: list[uuid.UUID]) -> tuple[int, str]:
    with engine.connect() as conn:
        row = conn.execute(FINGERPRINT, {"teams": [str(t) for t in teams]}).one()
    return int(row.n), str(row.digest)


def expected_end(plan: TaskPlan) -> tuple[str, int]:
    """(status, run) the task must end in."""
    if plan.case == "invalid":
        return "FAILED", 0
    if plan.case.startswith("cancel_") and plan.cancel_outcome == "cancelled":
        return "CANCELLED", 0
    if plan.case == "fail_retry":
        return "COMPLETED", 1
    return "COMPLETED", 0


class Verifier:
    def __init__(
        self,
        engine: sa.Engine,
        plans: list[TaskPlan],
        reminder_teams: list[uuid.UUID],
        max_attempts: int,
        judge: LeaseJudge,
        revokes: list[Revoke] | None = None,
        purges: list[Purge] | None = None,
        pool_kills: list[PoolKill] | None = None,
    ) -> None:
        self.engine, self.plans = engine, plans
        self.reminder_teams = reminder_teams
        self.max_attempts = max_attempts
        self.judge = judge
        self.revokes = {r.task_id: r for r in revokes or []}
        self.purges = purges or []
        self.pool_kills = pool_kills or []
        self.violations: list[Violation] = []
        self.rows: dict[uuid.UUID, Any] = {}
        self.verdicts: list[leases.Verdict] = []
        self.claims: list[leases.ClaimVerdict] = []
        self.revoked_ends: Counter[str] = Counter()
        self.purge_latency_s: list[float] = []
        self.excused: list[str] = []  # runs whose attempts faults used up
        self.lost_outcomes: Counter[str] = Counter()  # poolkill: what each report said
        self.lost_latency_s: list[float] = []  # poolkill: kill -> WAIT/FAIL audit row
        self.lost_notes: list[str] = []  # poolkill: reports a fault held up (excused)

    def add(
        self, what: str, plan: TaskPlan | None, detail: str, task_id: uuid.UUID | None = None
    ) -> None:
        described = plan.describe() if plan else "-"
        task_id = task_id or (plan.task_id if plan else None)
        self.violations.append(Violation(what, described, detail, task_id))

    def run(
        self,
        tickets_before: tuple[int, str],
        export_teams: list[uuid.UUID],
        incarnations: list[Incarnation],
    ) -> list[Violation]:
        with self.engine.connect() as conn:
            self.rows = {r.id: r for r in conn.execute(TASKS)}
            self._global(conn)
            self._leases(conn)
        self._exits(incarnations)
        self._tasks()
        self._revoked()
        self._purged()
        self._pool_kills()
        self._reminders()
        if fingerprint(self.engine, export_teams) != tickets_before:
            self.add("tickets-changed", None, "the exported teams' tickets changed during the soak")
        return self.violations

    def _global(self, conn: sa.Connection) -> None:
        for row in self.rows.values():
            if row.status in ("WAITING", "RUNNING"):
                self.add(
                    "not-finished",
                    self._plan_of(row.id),
                    f"is {row.status} (run {row.run})",
                    row.id,
                )
        known = {p.task_id for p in self.plans}
        for task_id in set(self.rows) - known:
            self.add("unknown-task", None, "was not created by the soak", task_id)
        for stale in audit.stale_writes(conn):
            self.add(
                "stale-write",
                self._plan_of(stale.task_id),
                f"audit #{stale.audit_id} {stale.event} run {stale.run} by {stale.execution_id}",
            )
        for task_id, n in audit.repeated_completions(conn).items():
            self.add("repeated-completion", self._plan_of(task_id), f"{n} COMPLETE rows")

    def _plan_of(self, task_id: uuid.UUID) -> TaskPlan | None:
        return next((p for p in self.plans if p.task_id == task_id), None)

    def _leases(self, conn: sa.Connection) -> None:
        """No RECOVER and no takeover of a live, running execution, and no CLAIM over a
        live, unfrozen holder of a row that is not stale (soak/leases.py)."""
        silences = leases.silences(conn)
        for revocation in leases.revocations(conn):
            if revocation.how == "TAKEOVER":
                self._claim(revocation, silences)
            verdict = self.judge.judge(revocation)
            self.verdicts.append(verdict)
            if verdict.justified:
                continue
            row = self.rows.get(revocation.task_id)
            hints = self.judge.hints(revocation, row.team_id if row is not None else None, verdict)
            self.add(
                "live-lease-revoked",
                self._plan_of(revocation.task_id),
                f"{revocation.how} (audit #{revocation.audit_id}, run {revocation.run}) of "
                f"{str(revocation.revoked)[:8]}: {verdict.why}; around it: {hints}",
                revocation.task_id,
            )

    def _claim(
        self, rev: leases.Revocation, silences: dict[tuple[uuid.UUID, uuid.UUID], float]
    ) -> None:
        silent_s = silences.get((rev.task_id, rev.claimer)) if rev.claimer else None
        verdict = self.judge.judge_claim(rev, silent_s)
        self.claims.append(verdict)
        if not verdict.justified:
            self.add(
                "claim-over-live-holder",
                self._plan_of(rev.task_id),
                f"CLAIM (audit #{rev.audit_id}, run {rev.run}) by "
                f"{str(rev.claimer)[:8]} over {str(rev.revoked)[:8]}: {verdict.why}",
                rev.task_id,
            )

    def _exits(self, incarnations: list[Incarnation]) -> None:
        """Only the soak stops processes: a worker or beat that exits by itself is one."""
        for inc in incarnations:
            if inc.unexpected:
                self.add(
                    "unexpected-exit",
                    None,
                    f"{inc.name} exited by itself (rc {inc.exit_code}); last lines:\n"
                    + "\n".join(f"      {line[:220]}" for line in last_lines(inc)),
                )

    def _tasks(self) -> None:
        for plan in self.plans:
            if plan.by_fault and plan.task_id is None and plan.create_error is None:
                continue  # its fault was skipped before it needed the task
            if plan.create_error is not None or plan.task_id is None:
                self.add("not-created", plan, plan.create_error or "never submitted")
                continue
            row = self.rows.get(plan.task_id)
            if row is None:
                self.add("missing", plan, "no ledger row")
                continue
            status, run = expected_end(plan)
            if plan.task_id in self.revokes and (row.status, row.run) in REVOKED_ENDS:
                status, run = row.status, row.run  # checked with its revoke (_revoked)
            if (row.status, row.run) != (status, run) and not self._exhausted_by_faults(
                plan, row, status
            ):
                false_recoveries = row.last_error == MSG_TOO_MANY_RECOVERIES
                if plan.task_id in self.revokes:
                    status = "CANCELLED or COMPLETED (revoked)"
                self.add(
                    "end-state",
                    plan,
                    f"is {row.status} run {row.run} (attempts {row.attempts}, recoveries "
                    f"{row.recoveries}, last_error {row.last_error!r}), expected {status} run {run}"
                    f"; cancel: {plan.cancel_outcome}"
                    + ("; FAILED by recoveries: were they false ones?" if false_recoveries else ""),
                )
            if row.filters != plan.filters:
                self.add("filters", plan, f"stored filters {row.filters!r} differ from the request")
            self._case(plan, row)
            if plan.kind == "EXPORT":
                self._export(plan, row)

    def _revoked(self) -> None:
        """Each revoked run ended CANCELLED by its revoke, or COMPLETED; never WAITING or
        RUNNING (a run that never ends)."""
        ids = [str(task_id) for task_id in self.revokes]
        if not ids:
            return
        with self.engine.connect() as conn:
            cancels = {r.task_id: r for r in conn.execute(CANCELS, {"ids": ids})}
        origin = self.judge.timeline.origin
        for task_id, revoke in self.revokes.items():
            plan, row = self._plan_of(task_id), self.rows.get(task_id)
            if row is None:
                continue
            how = "terminate" if revoke.terminate else "revoke"
            said = (
                f"{how} at {revoke.issued_at - origin:.1f}s of the chaos window, picked "
                f"{revoke.status}; the command: {revoke.command}"
            )
            self.revoked_ends[f"{row.status} ({how}, picked {revoke.status})"] += 1
            if row.status in ("WAITING", "RUNNING"):
                still = f"still {row.status} run {row.run} at the end (attempts {row.attempts})"
                self.add("revoke-never-ended", plan, f"{still}; {said}")
            cancel = cancels.get(task_id)
            if row.status != "CANCELLED":
                continue
            if cancel is None:
                self.add("revoke-cancel", plan, f"CANCELLED without a CANCEL audit row; {said}")
            elif int(cancel.n) != 1 or float(cancel.first) < revoke.issued_at:
                first = float(cancel.first) - revoke.issued_at
                self.add(
                    "revoke-cancel",
                    plan,
                    f"CANCELLED by {cancel.n} CANCEL rows, the first {first:+.1f}s from the "
                    f"revoke; {said}",
                )

    def _purged(self) -> None:
        """Every run whose message a purge took went again (re-published, claimed, ended)
        within PURGE_GOAL_S."""
        origin = self.judge.timeline.origin
        for purge in self.purges:
            for (task_id, run), after_s in purge.resumed_s.items():
                if after_s is not None:
                    self.purge_latency_s.append(after_s)
                idle_s = self._no_intake_s(purge, (task_id, run))
                if after_s is not None and after_s - idle_s <= PURGE_GOAL_S:
                    continue
                late = (
                    f"after {after_s:.1f}s ({idle_s:.1f}s of it while a fault stopped "
                    "every worker's intake)"
                    if after_s is not None
                    else f"not within {PURGE_WATCH_S:.0f}s"
                )
                stamp = purge.runs[(task_id, run)]
                self.add(
                    "purge-stalled",
                    self._plan_of(task_id),
                    f"run {run}: its message (stamp {stamp.isoformat()}) purged at "
                    f"{purge.at - origin:.1f}s of the chaos window; going again {late} "
                    f"(goal {PURGE_GOAL_S:.0f}s)",
                    task_id,
                )

    def _no_intake_s(self, purge: Purge, key: tuple[uuid.UUID, int]) -> float:
        """Seconds of a purged run's wait during which a fault stopped every worker's
        intake (INTAKE_FAULTS): the dispatcher publishes only into a consumed queue."""
        resumed_at, after_s = purge.resumed_at.get(key), purge.resumed_s.get(key)
        if resumed_at is None or after_s is None:
            return 0.0
        return self.judge.timeline.covered_s(INTAKE_FAULTS, resumed_at - after_s, resumed_at)

    def _lost_reports(self, task_id: uuid.UUID) -> dict[str, ProcessLost]:
        """The task's executions whose lost pool process was written as a failed attempt
        (``task.process_lost`` retry or failed), by execution id prefix."""
        return {
            lost.execution: lost
            for lost in self.judge.logs.lost
            if lost.task_id == str(task_id) and lost.outcome in ("retry", "failed")
        }

    def _exhausted_by_faults(self, plan: TaskPlan, row: Any, expected: str) -> bool:
        """A run FAILED on its last attempt where every failed attempt spans a database
        fault or lost its pool process, and ``last_error`` is the one its last attempt
        calls for: the attempt budget did its job (counted in the report, not a
        violation)."""
        if (row.status, expected) != ("FAILED", "COMPLETED"):
            return False
        with self.engine.connect() as conn:
            spans = list(conn.execute(FAILED_ATTEMPTS, {"task_id": row.id, "run": row.run}))
        final = [s for s in spans if s.event == "FAIL"]
        if not spans or len(final) != 1:
            return False
        lost = self._lost_reports(row.id)
        last = lost.get(str(final[0].execution)[:8])
        want = (
            MSG_EXHAUSTED.format(n=self.max_attempts)
            if last is None
            else MSG_LOST_FINAL.format(n=self.max_attempts, how=f"pid {last.pool_pid}, {last.exit}")
        )
        if row.last_error != want:
            return False
        faults = [(e.start, e.end) for e in self.judge.timeline.events if e.kind in DATABASE_FAULTS]
        cut = [
            s
            for s in spans
            if any(start <= float(s.ended) and end >= float(s.claimed) for start, end in faults)
        ]
        lost_spans = [s for s in spans if str(s.execution)[:8] in lost]
        # Every attempt lost its process: nothing in the soak does that (poolkill kills one
        # run's process at most MAX_TASK_ATTEMPTS - 1 times), so it is not excused.
        mixed = any(s not in lost_spans for s in spans)
        if mixed and all(s in cut or s in lost_spans for s in spans):
            self.excused.append(
                f"{plan.describe()}: {len(spans)} attempts, {len(cut)} cut by a database "
                f"fault, {len(lost_spans)} lost their pool process"
            )
            return True
        return False

    def _pool_kills(self) -> None:
        """Each pool process the ``poolkill`` fault killed was the run's failed attempt,
        reported by its worker's main process; never a recovery (the module's docstring)."""
        self._unmatched_reports()
        if not self.pool_kills:
            return
        with self.engine.connect() as conn:
            for killed in self.pool_kills:
                trail = list(
                    conn.execute(RUN_TRAIL, {"task_id": killed.task_id, "run": killed.run})
                )
                self._pool_kill(killed, trail)

    def _pool_kill(self, killed: PoolKill, trail: list[Any]) -> None:
        plan = self._plan_of(killed.task_id)
        origin = self.judge.timeline.origin
        what = (
            f"pool pid {killed.pid} of {killed.process} SIGKILLed at {killed.at - origin:.1f}s "
            f"running execution {killed.execution[:8]} (attempt {killed.attempt})"
        )
        claims = [
            n for n, r in enumerate(trail) if r.event == "CLAIM" and r.execution == killed.execution
        ]
        after = trail[claims[-1] + 1] if claims and claims[-1] + 1 < len(trail) else None
        shown = (
            f"next audit row {after.event} by {str(after.execution)[:8]} "
            f"{float(after.at) - killed.at:+.1f}s after the kill"
            if after is not None
            else (
                "no audit row after its CLAIM" if claims else "its CLAIM is not in the audit trail"
            )
        )
        reports = [
            lost
            for lost in self.judge.logs.lost
            if (lost.process, lost.pool_pid) == (killed.process, killed.pid)
        ]
        report = reports[0] if reports else None
        self.lost_outcomes[report.outcome if report else "none"] += 1
        if killed.row_problem is not None:
            self.add(
                "process-lost-row", plan, f"{what}: the row after the report: {killed.row_problem}"
            )
        if report is None:
            self.add(
                "process-lost-unreported",
                plan,
                f"{what}: no task.process_lost from its worker's main process; {shown}",
            )
            return
        said = f"reported {report.outcome} {report.at - killed.at:+.1f}s after the kill"
        wrong = []
        if report.execution != killed.execution[:8]:
            wrong.append(f"named execution {report.execution}")
        if (report.task_id, report.run) != (str(killed.task_id), killed.run):
            wrong.append(f"named run {report.task_id}-{report.run}")
        if report.exit != "signal 9 (SIGKILL)":
            wrong.append(f"exit {report.exit!r}")
        if report.pid in (0, killed.pid):
            wrong.append(f"logged by pid {report.pid}, not its worker's main process")
        if len(reports) > 1:
            wrong.append(f"{len(reports)} reports")
        delayed = self._held_up(LOST_DELAY_FAULTS, killed.at, report.at)
        if report.outcome in ("retry", "failed"):
            event = "WAIT" if report.outcome == "retry" else "FAIL"
            if after is None or (after.event, after.execution) != (event, killed.execution):
                wrong.append(f"but {shown} (expected {event} by it)")
            elif report.attempt != killed.attempt:
                wrong.append(f"attempt {report.attempt}, the lost one was {killed.attempt}")
            else:
                late_s = float(after.at) - killed.at
                self.lost_latency_s.append(late_s)
                if late_s > LOST_REPORT_GOAL_S:
                    if delayed:
                        self.lost_notes.append(
                            f"{what}: {event} after {late_s:.1f}s, held up by {delayed}"
                        )
                    else:
                        self.add(
                            "process-lost-slow",
                            plan,
                            f"{what}: its {event} came {late_s:.1f}s after the kill (goal "
                            f"{LOST_REPORT_GOAL_S:g}s), no fault holding it up",
                        )
        elif report.outcome == "unreported":
            excuse = self._held_up(LOST_UNREPORTED_FAULTS, killed.at, report.at)
            if excuse:
                self.lost_notes.append(f"{what}: unreported, held up by {excuse}; {shown}")
            else:
                self.add(
                    "process-lost-unreported",
                    plan,
                    f"{what}: {said}, no database fault keeping it away; {shown}",
                )
        elif report.outcome == "not_held":
            own = after is not None and (
                (after.event in OWN_ENDS and after.execution == killed.execution)
                or after.event == "CANCEL"
            )
            if not own and not (after is not None and after.event in ("RECOVER", "CLAIM")):
                wrong.append(f"not_held, but {shown}")
        else:
            wrong.append(f"outcome {report.outcome!r}")
        if after is not None and (
            after.event == "RECOVER"
            or (after.event == "CLAIM" and after.execution != killed.execution)
        ):
            if delayed and report.outcome == "unreported":
                pass  # noted above with its excuse
            elif delayed and report.outcome == "not_held":
                self.lost_notes.append(
                    f"{what}: taken back by {after.event}, report held up by {delayed}; {said}"
                )
            else:
                self.add(
                    "process-lost-recovered",
                    plan,
                    f"{what}: {said}; {shown}: the lost process's run was taken back, not "
                    "written as its failed attempt",
                )
        if wrong:
            self.add("process-lost-report", plan, f"{what}: {said}: {'; '.join(wrong)}")

    def _unmatched_reports(self) -> None:
        """A lost-process report for a pool process the soak did not kill: a violation when
        ``celery control terminate`` killed it (Celery caused that loss: the revoke owns
        the run, the worker must not write it as a failed attempt), else a note (a pool
        process may die of its own accord)."""
        killed = {(k.process, k.pid) for k in self.pool_kills}
        for lost in self.judge.logs.lost:
            if (lost.process, lost.pool_pid) in killed:
                continue
            message = f"{lost.task_id}-{lost.run}"
            terminated = [
                at
                for at, process, named in self.judge.logs.terminations
                if (process, named) == (lost.process, message) and at <= lost.at
            ]
            said = (
                f"{lost.process} reported pool pid {lost.pool_pid} lost ({lost.exit}) running "
                f"execution {lost.execution}: {lost.outcome}"
            )
            if terminated and lost.outcome in ("retry", "failed"):
                self.add(
                    "process-lost-report",
                    self._plan_of(uuid.UUID(lost.task_id)),
                    f"{said}, {lost.at - max(terminated):.1f}s after control terminate killed it",
                )
            else:
                self.lost_notes.append(f"not killed by the soak: {said}")

    def _held_up(self, kinds: dict[str, float], start: float, end: float) -> str:
        """The faults of ``kinds`` (plus each one's recovery time) that overlap
        [start, end], named for the report ("" when none)."""
        timeline = self.judge.timeline
        found = [
            f"{e.kind} {e.start - timeline.origin:.1f}s..{e.end - timeline.origin:.1f}s"
            for e in timeline.events
            if e.kind in kinds and e.start <= end and e.end + kinds[e.kind] >= start
        ]
        return ", ".join(found)

    def _case(self, plan: TaskPlan, row: Any) -> None:
        if plan.case == "invalid" and (row.attempts, row.last_error) != (1, plan.error):
            self.add(
                "rejection",
                plan,
                f"attempts {row.attempts}, last_error {row.last_error!r}; expected 1, "
                f"{plan.error!r}",
            )
        if plan.case == "fail_retry":
            exhausted = MSG_EXHAUSTED.format(n=self.max_attempts)
            seen = plan.run0 or {}
            ok = (
                seen.get("status") == "FAILED"
                and seen.get("attempts") == self.max_attempts
                and seen.get("last_error") == exhausted
            )
            if not ok:
                self.add(
                    "last-attempt",
                    plan,
                    f"run 0 ended {seen}; expected FAILED, "
                    f"attempts {self.max_attempts}, {exhausted!r}",
                )

    def _export(self, plan: TaskPlan, row: Any) -> None:
        if row.status != "COMPLETED":
            if row.result_csv is not None:
                self.add("export-csv", plan, f"a {row.status} export keeps a CSV")
            return
        summary = f"{plan.rows} rows"
        if (row.result_summary, row.progress) != (summary, 100):
            self.add(
                "export-summary",
                plan,
                f"summary {row.result_summary!r} progress {row.progress}; expected {summary!r} 100",
            )
        want = expected_csv(self.engine, row.team_id, row.owner_id, row.scope, plan.filters)
        if row.result_csv != want:
            self.add(
                "export-csv",
                plan,
                f"CSV differs from the reference ({_first_diff(row.result_csv, want)})",
            )

    def _reminders(self) -> None:
        with self.engine.connect() as conn:
            notes = list(conn.execute(NOTIFICATIONS))
            events = list(conn.execute(EVENTS))
            tickets = {
                r.id: r
                for r in conn.execute(VERSIONS, {"teams": [str(t) for t in self.reminder_teams]})
            }
        notes_by_task = Counter({r.task_id: int(r.n) for r in notes})
        events_by_ticket: dict[uuid.UUID, list[Any]] = {}
        for event in events:
            events_by_ticket.setdefault(event.ticket_id, []).append(event)
        reminders = [p for p in self.plans if p.kind == "REMINDER" and p.task_id is not None]
        owned_tickets = {p.ticket_id for p in reminders}
        for plan in reminders:
            assert plan.task_id is not None
            row = self.rows.get(plan.task_id)
            completed = row is not None and row.status == "COMPLETED"
            self._side_effects(plan, completed, notes_by_task, events_by_ticket, tickets)
        stray_notes = set(notes_by_task) - {p.task_id for p in reminders}
        stray_events = set(events_by_ticket) - owned_tickets
        if stray_notes or stray_events:
            self.add(
                "stray-side-effect",
                None,
                f"{len(stray_notes)} notifications, "
                f"{len(stray_events)} tickets with events not made by a soak reminder",
            )

    def _side_effects(
        self,
        plan: TaskPlan,
        completed: bool,
        notes_by_task: Counter[uuid.UUID],
        events_by_ticket: dict[uuid.UUID, list[Any]],
        tickets: dict[uuid.UUID, Any],
    ) -> None:
        assert plan.ticket_id is not None and plan.task_id is not None
        want = 1 if completed else 0
        events = events_by_ticket.get(plan.ticket_id, [])
        ticket = tickets.get(plan.ticket_id)
        got = (
            notes_by_task.get(plan.task_id, 0),
            len(events),
            ticket.version if ticket is not None else None,
        )
        if got != (want, want, want):
            self.add(
                "reminder-effects",
                plan,
                f"notifications {got[0]}, events {got[1]}, version +{got[2]}; expected {want} each",
            )
        elif events and (events[0].type, events[0].task_id) != (EVENT_TYPE, str(plan.task_id)):
            self.add(
                "reminder-effects", plan, f"event {events[0].type} for task {events[0].task_id}"
            )

    def audit_trail(self, task_id: uuid.UUID) -> list[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(AUDIT_TRAIL, {"task_id": task_id})
            return [
                f"    audit #{r.id} run {r.run} {r.event:9} {r.execution_id} {r.at.isoformat()}"
                for r in rows
            ]


def last_lines(inc: Incarnation, limit: int = 4) -> list[str]:
    """An incarnation's last output lines (its own words about why it exited)."""
    try:
        lines = inc.log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-limit:]


def stats(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        statuses = Counter(
            r.status for r in conn.execute(sa.text("SELECT status FROM background_tasks"))
        )
        recoveries = conn.execute(
            sa.text("SELECT coalesce(max(recoveries), 0) AS mx FROM background_tasks")
        ).scalar_one()
        events = {r.event: int(r.n) for r in conn.execute(AUDIT_COUNTS)}
    return {"statuses": dict(statuses), "max_recoveries": int(recoveries), "audit": events}


def _first_diff(got: str | None, want: str) -> str:
    if got is None:
        return "no CSV stored"
    got_lines, want_lines = got.split("\n"), want.split("\n")
    for n, (a, b) in enumerate(zip(got_lines, want_lines, strict=False)):
        if a != b:
            return f"line {n + 1}: got {a[:80]!r}, expected {b[:80]!r}"
    return f"{len(got_lines)} lines, expected {len(want_lines)}"
