"""No lease is taken from a live execution: the audit trail against what the soak did.

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
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import sqlalchemy as sa

from soak.logscan import Execution, Logs
from soak.timeline import DEAD, DRAINING, FROZEN, Timeline

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
                   AS revoked
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


@dataclass(frozen=True)
class Revocation:
    audit_id: int
    task_id: uuid.UUID
    run: int
    how: str  # RECOVER or TAKEOVER
    at: float  # database clock, epoch seconds
    revoked: uuid.UUID | None
    claimed: float | None  # when the revoked execution claimed (its CLAIM's time)


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
        )
        for r in conn.execute(REVOCATIONS)
    ]


@dataclass
class LeaseJudge:
    logs: Logs
    timeline: Timeline
    grace_s: float

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
