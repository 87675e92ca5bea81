"""No lease is taken from a live execution, and no CLAIM takes a RUNNING row from a live,
unfrozen holder: the audit trail against what the soak did.

A lease is revoked in two ways, both in ``task_audit``:

- ``RECOVER`` (the dispatcher took the run back) names the revoked execution;
- a ``CLAIM`` that directly follows another execution's ``CLAIM`` of the task took the
  RUNNING row over (a takeover): the previous CLAIM's execution is revoked.

A revocation at time T (``task_audit.at``, the database's clock) is justified when the
revoked execution had already ended (its closing log line is before T: it gave up without
being able to tell the ledger, e.g. PostgreSQL was restarting), or when its process was,
at T, dead (killed, exited, in a cold shutdown) or frozen (SIGSTOP of the worker, of its
main process - the heartbeat is the main process's - or of that very pool process), up to
``grace_s`` after the SIGCONT (the dispatcher may have read the heartbeats just before it).
Anything else took a lease from a live, running execution: a violation. A draining
worker (SIGTERM) is alive: its leases must survive the drain.

The holder of each execution and its end come from the workers' logs (soak/logscan.py),
the process states from the timeline (soak/timeline.py).

**No CLAIM over a live, unfrozen holder** (``claim-over-live-holder``). A claim takes a
RUNNING row over only when the row is stale by the database's clock (its last write older
than ``STALE_AFTER_S`` at the claim): nothing else may take a row over any more (Celery's
re-send after a lost pool process, which took the row over at once, is gone: the worker's
main process reports the loss, below). So every takeover (a CLAIM directly after another
execution's CLAIM, as above) is judged again, on the row's staleness first:

- *stale*: the row's last write before the claim is older than ``STALE_AFTER_S``, measured
  as the claim itself measured it. The audit trail does not record progress writes, so the
  soak records every takeover in its own table ``soak_takeovers`` from a trigger on
  ``background_tasks`` (only for an update that changes the execution of a RUNNING row and
  leaves it RUNNING: a claim's takeover; the workers' progress writes do not even call
  it): the row's ``updated_at`` before the claim and the claim's ``now()`` (the new
  ``updated_at``), the very values the claim's staleness guard compared, in the claim's own
  transaction (a crash that loses the claim loses the record with it);
- *fresh*: the recorded silence is not over ``STALE_AFTER_S``: a violation whatever the
  holder's state (the claim's guard let through a row it had to refuse). Only when the
  silence was not recorded does the holder's state decide, as below;
- *dead*: the holder's process was dead at the claim: its worker killed, exited, in a cold
  shutdown, or its pool process killed by ``celery control terminate``, by its own worker
  (logged by the worker, soak/logscan.py) or by the ``poolkill`` fault (the timeline's
  ``dead`` window on that pool process, and its main process's ``task.process_lost``);
- *frozen*: the process running the execution was stopped at the claim: its worker's whole
  process group (``stop``), or that pool process (``txfreeze``). No grace after the
  SIGCONT: the claim does not read heartbeats. A ``stop`` of the worker's main process
  only leaves its pool processes running, so it does not excuse a takeover (when the
  execution never logged its start, its pool pid is unknown and any stop of its worker
  does);
- otherwise the holder was alive, unfrozen and writing within ``STALE_AFTER_S``: a
  violation, even when its execution had already ended (then it ended without telling the
  ledger, and the row is not stale yet: the claim rule must wait for that).

A pool process lost under a live worker (the ``poolkill`` fault, the OOM killer) is no
revocation at all: its worker's main process writes the lost attempt under that very
execution's lease (``ledger.lease.report_lost``), so the trail shows CLAIM, then WAIT or
FAIL by the same execution - a write by the lease holder, like the execution's own
failure report - and the next CLAIM follows that WAIT, not a CLAIM: not a takeover.
Only when the report could not be written (``task.process_lost`` ``unreported``: the
database away for half of ``STALE_AFTER_S``) does the staleness rule take the run back;
that RECOVER is judged like any other: the execution ended (its ``task.process_lost``
line, or billiard's exit line), and the timeline has the pool process ``dead`` from the
kill (soak/timeline.py). That the loss was written, in time and never as a recovery, is
the lost-process rule of soak/checks.py.

A takeover whose holder cannot be named from the logs (no ``task.started`` and no receipt)
is counted as not judged (``unknown``), not as a violation. So is one without its
``soak_takeovers`` row (never seen) unless the holder's own CLAIM is less than
``STALE_AFTER_S`` old: then the row cannot have been stale (the claim wrote it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import sqlalchemy as sa

from soak.logscan import PROCESS_LOST, TERMINATED, Execution, Logs, killed
from soak.timeline import DEAD, DRAINING, FROZEN, MAIN_ONLY, Timeline

REVOCATIONS = sa.text("""
    WITH ordered AS (
        SELECT id, task_id, run, event, execution_id, at,
               lag(event) OVER w AS previous_event,
               lag(execution_id) OVER w AS previous_execution
          FROM task_audit
        WINDOW w AS (PARTITION BY task_id ORDER BY id)
    ), revoked AS (
        SELECT id, task_id, run, extract(epoch FROM at) AS epoch,
               CASE WHEN event = 'RECOVER' THEN 'RECOVER' ELSE 'TAKEOVER' END AS how,
               CASE WHEN event = 'RECOVER' THEN execution_id ELSE previous_execution END
                   AS revoked,
               CASE WHEN event = 'CLAIM' THEN execution_id END AS claimer
          FROM ordered
         WHERE event = 'RECOVER'
            OR (event = 'CLAIM' AND previous_event = 'CLAIM'
                AND previous_execution IS DISTINCT FROM execution_id)
    )
    SELECT r.*, (SELECT extract(epoch FROM c.at) FROM task_audit c
                  WHERE c.task_id = r.task_id AND c.execution_id = r.revoked
                    AND c.event = 'CLAIM' ORDER BY c.id DESC LIMIT 1) AS claimed
      FROM revoked r ORDER BY r.id
""")
HINT_WINDOW_S = 15.0  # a platform fault this recent is named next to a violation
CLAIM_SLACK_S = 0.5  # a claim's now() may precede its audit row's clock_timestamp() by this

# The soak's own record of every takeover of a RUNNING row (see the module's docstring):
# created with the soak's database, before any worker starts.
RECORD_TAKEOVERS = (
    sa.text("""
        CREATE TABLE soak_takeovers (
            task_id uuid NOT NULL,
            run integer NOT NULL,
            execution_id uuid,
            previous_execution uuid,
            previous_updated_at timestamptz NOT NULL,
            claimed_at timestamptz NOT NULL
        )
    """),
    sa.text("""
        CREATE FUNCTION soak_record_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO soak_takeovers VALUES
                (NEW.id, NEW.run, NEW.execution_id, OLD.execution_id, OLD.updated_at,
                 NEW.updated_at);
            RETURN NULL;
        END
        $$
    """),
    sa.text("""
        CREATE TRIGGER soak_takeover AFTER UPDATE ON background_tasks FOR EACH ROW
          WHEN (OLD.status = 'RUNNING' AND NEW.status = 'RUNNING'
                AND NEW.execution_id IS DISTINCT FROM OLD.execution_id)
          EXECUTE FUNCTION soak_record_takeover()
    """),
)
# How long each takeover's row had been silent when the claim took it (the claim's now()).
SILENCES = sa.text("""
    SELECT task_id, execution_id,
           extract(epoch FROM claimed_at - previous_updated_at) AS silent_s
      FROM soak_takeovers
""")


@dataclass(frozen=True)
class Revocation:
    audit_id: int
    task_id: uuid.UUID
    run: int
    how: str  # RECOVER or TAKEOVER
    at: float  # database clock, epoch seconds
    revoked: uuid.UUID | None
    claimed: float | None  # when the revoked execution claimed (its CLAIM's time)
    claimer: uuid.UUID | None = None  # TAKEOVER: the execution that claimed


@dataclass(frozen=True)
class Verdict:
    revocation: Revocation
    reason: str  # ended, dead, frozen, cold, unknown - or live (a violation)
    why: str  # the details: what justified it, or what the holder was doing
    execution: Execution | None

    @property
    def justified(self) -> bool:
        return self.reason != "live"


def revocations(conn: sa.Connection) -> list[Revocation]:
    return [
        Revocation(
            r.id,
            r.task_id,
            r.run,
            r.how,
            float(r.epoch),
            r.revoked,
            None if r.claimed is None else float(r.claimed),
            r.claimer,
        )
        for r in conn.execute(REVOCATIONS)
    ]


@dataclass(frozen=True)
class ClaimVerdict:
    """A takeover judged by the rule "no CLAIM over a live, unfrozen holder"."""

    revocation: Revocation
    # stale, dead, terminated, cold, frozen, unknown - or live, fresh (violations)
    reason: str
    why: str
    silent_s: float | None  # the row's silence at the claim (None: not recorded)

    @property
    def justified(self) -> bool:
        return self.reason not in ("live", "fresh")


def silences(conn: sa.Connection) -> dict[tuple[uuid.UUID, uuid.UUID], float]:
    """(task, claiming execution) -> seconds the row had been silent at the takeover."""
    return {
        (r.task_id, r.execution_id): float(r.silent_s)
        for r in conn.execute(SILENCES)
        if r.execution_id is not None
    }


@dataclass
class LeaseJudge:
    logs: Logs
    timeline: Timeline
    grace_s: float
    stale_after_s: float = 0.0

    def judge(self, rev: Revocation) -> Verdict:
        prefix = str(rev.revoked)[:8] if rev.revoked is not None else ""
        execution = self.logs.executions.get((str(rev.task_id), prefix))
        if execution is None:
            return self._unlogged(rev)
        if execution.ended_at is not None and execution.ended_at <= rev.at:
            ago = rev.at - execution.ended_at
            why = f"ended {ago:.1f}s before ({execution.end})"
            return Verdict(rev, "ended", why, execution)
        state = self._process_state(execution.process, execution.pid, rev.at)
        if state is not None:
            return Verdict(rev, state[0], state[1], execution)
        return Verdict(rev, "live", self._alive(execution, rev.at), execution)

    def _unlogged(self, rev: Revocation) -> Verdict:
        """An execution that never logged task.started: its process was stopped between
        its claim and that line (a kill, most likely). The worker that logged receiving
        the run's message just before the claim is its holder."""
        process = None
        if rev.claimed is not None:
            process = self.logs.received_by(f"{rev.task_id}-{rev.run}", rev.claimed)
        state = self._process_state(process, None, rev.at) if process is not None else None
        if state is not None:
            return Verdict(rev, state[0], f"{state[1]}, before it logged its start", None)
        held = f"received by {process}" if process else "no receipt either"
        return Verdict(rev, "unknown", f"never logged task.started ({held})", None)

    def _process_state(self, process: str, pid: int | None, at: float) -> tuple[str, str] | None:
        """(reason, details) when the holder could not be running at ``at``, else None."""
        windows = self.timeline.of(process)
        if pid is not None:
            windows += self.timeline.of(f"{process}/{pid}")
        for window in windows:
            if window.state in (DEAD, FROZEN) and window.covers(at, self.grace_s):
                return window.state, f"{window.process} {window.state} ({window.cause})"
        cold = self.logs.cold.get(process)
        if cold is not None and cold <= at:
            return "cold", f"{process} going down (cold shutdown or crash)"
        return None

    def judge_claim(self, rev: Revocation, silent_s: float | None) -> ClaimVerdict:
        """A takeover (CLAIM of a RUNNING row) against "no CLAIM over a live, unfrozen
        holder" (the module's docstring)."""
        if silent_s is None and rev.claimed is not None:
            # Not recorded (never so far): the holder's own claim wrote the row, so its
            # silence is at most the time since that claim (plus the claim's own duration).
            bound = rev.at - rev.claimed + CLAIM_SLACK_S
            silence = f"row silent at most {bound:.1f}s (since its claim)"
            stale = None if bound < self.stale_after_s else "maybe"
        elif silent_s is None:
            silence, stale = "silence not recorded", "maybe"
        else:
            silence = f"row silent {silent_s:.1f}s"
            stale = "yes" if silent_s > self.stale_after_s else None
        if stale == "yes":
            return ClaimVerdict(rev, "stale", silence, silent_s)
        if silent_s is not None:
            why = f"{silence}, STALE_AFTER_S {self.stale_after_s:g}: only a stale row is taken over"
            return ClaimVerdict(rev, "fresh", why, silent_s)
        execution = self.logs.executions.get((str(rev.task_id), str(rev.revoked)[:8]))
        process, pid = (execution.process, execution.pid) if execution else (None, None)
        if execution is None and rev.claimed is not None:
            process = self.logs.received_by(f"{rev.task_id}-{rev.run}", rev.claimed)
        if execution is not None and killed(execution):
            assert execution.ended_at is not None
            if execution.ended_at <= rev.at:
                ago = rev.at - execution.ended_at
                if execution.end == TERMINATED:
                    why = f"its pool process was killed by control terminate {ago:.1f}s before"
                elif str(execution.end).startswith(PROCESS_LOST):
                    why = f"its pool process was lost ({execution.end}) {ago:.1f}s before"
                else:
                    why = f"its pool process was killed by its worker {ago:.1f}s before"
                return ClaimVerdict(rev, "terminated", f"{why}; {silence}", silent_s)
        if process is None:
            why = f"holder not named by the logs; {silence}"
            return ClaimVerdict(rev, "unknown", why, silent_s)
        state = self._holder_state(process, pid, rev.at)
        if state is not None:
            return ClaimVerdict(rev, state[0], f"{state[1]}; {silence}", silent_s)
        alive = self._alive(execution, rev.at) if execution else f"holder {process} alive"
        if stale == "maybe":
            return ClaimVerdict(rev, "unknown", f"{alive}; {silence}", silent_s)
        why = f"{alive}; {silence}, STALE_AFTER_S {self.stale_after_s:g}"
        return ClaimVerdict(rev, "live", why, silent_s)

    def _holder_state(self, process: str, pid: int | None, at: float) -> tuple[str, str] | None:
        """(reason, details) when the process running the execution was dead or stopped
        at ``at`` (no grace after a SIGCONT), else None."""
        windows = self.timeline.of(process)
        if pid is not None:
            windows += self.timeline.of(f"{process}/{pid}")
        for window in windows:
            if not window.covers(at, 0.0):
                continue
            if window.state == DEAD:
                return DEAD, f"{window.process} dead ({window.cause})"
            main_only = window.note == MAIN_ONLY and window.process == process
            if window.state == FROZEN and not (main_only and pid is not None):
                return FROZEN, f"{window.process} frozen ({window.cause})"
        cold = self.logs.cold.get(process)
        if cold is not None and cold <= at:
            return "cold", f"{process} going down (cold shutdown or crash)"
        return None

    def _alive(self, execution: Execution, at: float) -> str:
        """What the live holder was doing (for the report)."""
        state = "alive"
        for window in self.timeline.of(execution.process):
            if window.state == DRAINING and window.covers(at, 0.0):
                state = f"draining since {at - window.start:.1f}s ({window.cause})"
        end = (
            f"ended {execution.ended_at - at:.1f}s later ({execution.end})"
            if execution.ended_at is not None
            else "never logged its end"
        )
        return (
            f"holder {execution.process} pid {execution.pid} {state}; the execution "
            f"(started {at - execution.started_at:.1f}s before) {end}"
        )

    def hints(self, rev: Revocation, team_id: uuid.UUID | None, verdict: Verdict) -> str:
        """Faults around the moment, to help read a violation."""
        recent = [
            f"{e.kind} {rev.at - e.start:.1f}s before"
            for e in self.timeline.events
            if e.start <= rev.at <= e.end + HINT_WINDOW_S
        ]
        frozen = [
            f"txfreeze of its team's reminder since {rev.at - w.start:.1f}s"
            if w.cause == "txfreeze" and team_id is not None and w.note == str(team_id)
            else f"{w.process} frozen ({w.cause}) since {rev.at - w.start:.1f}s"
            for w in self.timeline.windows
            if w.state == FROZEN and w.covers(rev.at, self.grace_s)
        ]
        if verdict.reason == "live" and "draining" in verdict.why:
            recent.append("holder draining")
        return "; ".join(frozen + recent) or "no fault nearby"
