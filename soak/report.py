"""What the soak prints after its checks: counts, notes and each violation with the task's
audit trail and the worker log lines naming it. Everything also goes to ``report.txt``."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from soak import checks, logscan, tools, workload
from soak.chaos import KINDS, Chaos, Record
from soak.cluster import Cluster, Incarnation

REPORT_LIMIT = 40  # violations printed with their details (all of them go to report.txt)
LOGGED_EVENTS = (
    "task.lease_lost",
    "task.cancelled",
    "task.stalled",
    "task.skipped",
    "task.revoked",
    "task.refused",
    "task.attempt_failed",
    "task.process_lost",
    "worker.shutdown_timeout",
    "dispatcher.failed",
)


@dataclass
class Report:
    say: Callable[[str], None]
    workdir: Path
    engine: sa.Engine
    cluster: Cluster

    def counts(
        self,
        plans: list[workload.TaskPlan],
        records: list[Record],
        chaos: Chaos,
        operator: workload.Operator,
    ) -> None:
        cases = Counter(p.case for p in plans if p.task_id is not None)
        cancels = Counter(p.cancel_outcome for p in plans if p.case.startswith("cancel_"))
        self.say(f"soak: cases {dict(sorted(cases.items()))}; cancels {dict(cancels)}")
        self.say(f"soak: faults {fault_counts(records)}")
        skipped = Counter(r.kind for r in records if not r.injected)
        if skipped:
            self.say(f"soak: faults skipped {dict(sorted(skipped.items()))} (see faults.txt)")
        self.say(f"soak: SIGTERM exit codes {dict(Counter(chaos.term_exit_codes))}")
        self.say(f"soak: process exits {exit_counts(self.cluster)}")
        self.say(f"soak: ledger {checks.stats(self.engine)}")
        self.say(f"soak: worker logs {log_counts(self.cluster)}")
        for error in operator.errors[:5]:
            self.say(f"soak: note: user action error {error}")
        origin = datetime.fromtimestamp(chaos.timeline.origin, UTC).isoformat(
            timespec="milliseconds"
        )
        lines = [r.line() for r in records] + ["", f"timeline (database clock, 0 s = {origin}):"]
        (self.workdir / "faults.txt").write_text("\n".join(lines + chaos.timeline.lines()) + "\n")

    def leases(self, verifier: checks.Verifier) -> None:
        """How every revocation in the audit trail was judged."""
        verdicts = verifier.verdicts
        why = Counter(v.reason for v in verdicts if v.justified)
        unknown = why.get("unknown", 0)
        self.say(
            f"soak: revocations {len(verdicts)} (RECOVER "
            f"{sum(1 for v in verdicts if v.revocation.how == 'RECOVER')}, TAKEOVER "
            f"{sum(1 for v in verdicts if v.revocation.how == 'TAKEOVER')}); justified by "
            f"{dict(sorted(why.items()))}, of a live execution "
            f"{sum(1 for v in verdicts if not v.justified)}"
        )
        for verdict in [v for v in verdicts if v.reason == "unknown"][:5]:
            rev = verdict.revocation
            self.say(
                f"soak: note: {rev.how} of {str(rev.revoked)[:8]} (task {rev.task_id}, audit "
                f"#{rev.audit_id}) not judged: {verdict.why}"
            )
        if unknown > 5:
            self.say(f"soak: note: {unknown - 5} more revocations not judged")
        for line in verifier.excused[:10]:
            self.say(f"soak: note: attempts used up by database faults: {line}")
        claims = verifier.claims
        why = Counter(c.reason for c in claims if c.justified)
        recorded = sum(1 for c in claims if c.silent_s is not None)
        self.say(
            f"soak: claims over a RUNNING row {len(claims)} (silence recorded {recorded}); "
            f"justified by {dict(sorted(why.items()))}, over a live, unfrozen holder "
            f"{sum(1 for c in claims if not c.justified)}"
        )
        for claim in [c for c in claims if c.reason == "unknown"][:5]:
            rev = claim.revocation
            self.say(
                f"soak: note: CLAIM over {str(rev.revoked)[:8]} (task {rev.task_id}, audit "
                f"#{rev.audit_id}) not judged: {claim.why}"
            )

    def tools(self, verifier: checks.Verifier) -> None:
        """What Celery's command line did: how the revoked runs ended, how soon the purged
        ones went again."""
        self.say(f"soak: revoked runs ended {dict(sorted(verifier.revoked_ends.items()))}")
        latency = sorted(verifier.purge_latency_s)
        runs = sum(len(p.runs) for p in verifier.purges)
        purged = sum(p.purged or 0 for p in verifier.purges)
        shown = (
            f"going again after median {latency[len(latency) // 2]:.1f}s, max {latency[-1]:.1f}s"
            if latency
            else "none to watch"
        )
        self.say(
            f"soak: purges {len(verifier.purges)}: {purged} messages purged, {runs} runs "
            f"seen waiting just before, {shown} (goal {tools.PURGE_GOAL_S:.0f}s)"
        )

    def pool_kills(self, verifier: checks.Verifier) -> None:
        """What the worker's main process said of each pool process the soak killed, and
        how soon the lost attempt was written."""
        kills = verifier.pool_kills
        for note in verifier.lost_notes[:10]:
            self.say(f"soak: note: lost pool process: {note}")
        if not kills:
            return
        latency = sorted(verifier.lost_latency_s)
        shown = (
            f"written after median {latency[len(latency) // 2]:.2f}s, max {latency[-1]:.2f}s"
            if latency
            else "none written"
        )
        runs = Counter((k.task_id, k.run) for k in kills)
        self.say(
            f"soak: pool processes killed {len(kills)} ({sum(1 for n in runs.values() if n > 1)} "
            f"runs twice): reported {dict(sorted(verifier.lost_outcomes.items()))}, {shown} "
            f"(goal {checks.LOST_REPORT_GOAL_S:g}s)"
        )

    def violations(self, found: list[checks.Violation], verifier: checks.Verifier) -> list[str]:
        """Print the first REPORT_LIMIT violations with their details; return the lines of
        the others (for report.txt)."""
        unprinted: list[str] = []
        traced: set[uuid.UUID] = set()
        for n, violation in enumerate(found):
            lines = [violation.line()]
            if violation.task_id is not None and violation.task_id not in traced:
                traced.add(violation.task_id)
                lines += verifier.audit_trail(violation.task_id)
                lines += log_lines(self.cluster, violation.task_id)
            if n < REPORT_LIMIT:
                for line in lines:
                    self.say(line)
            else:
                unprinted += lines
        return unprinted


def fault_counts(records: list[Record]) -> str:
    """Injected faults per kind, every kind named (0 when none was injected)."""
    injected = Counter(r.kind for r in records if r.injected)
    return ", ".join(f"{kind} {injected.get(kind, 0)}" for kind in KINDS)


def exit_counts(cluster: Cluster) -> str:
    """Every process exit during the soak: caused by the soak (by fault) or not."""
    exits = [inc for inc in cluster.incarnations() if inc.exited and inc.cause != "final"]
    caused = Counter(inc.cause for inc in exits if not inc.unexpected)
    unexpected = [inc.name for inc in exits if inc.unexpected]
    return (
        f"{len(exits)}: caused by the soak {dict(sorted(caused.items()))}, "
        f"unexpected {len(unexpected)} {unexpected}"
    )


def log_counts(cluster: Cluster) -> dict[str, int]:
    """Events the workers and the dispatcher logged; ``missing_from_broker``: the runs the
    dispatcher's scans published again because the broker no longer held their message;
    ``overdue``: those published again past LOST_AFTER because the broker could not list
    their queue (a list longer than ``LIST_LIMIT``: rare on the soak's Redis)."""
    counts: Counter[str] = Counter()
    for inc in cluster.incarnations():
        with suppress(OSError):
            text = inc.log.read_text(errors="replace")
            for event in LOGGED_EVENTS:
                counts[event] += text.count(f'"event": "{event}"')
            counts["fatal"] += text.count('"level": "fatal"')
            for record in logscan.records(inc):
                if record.get("event") == "dispatcher.scan":
                    for field in ("missing_from_broker", "overdue"):
                        counts[field] += int(record.get(field) or 0)
    return dict(counts)


def log_lines(cluster: Cluster, task_id: uuid.UUID, limit: int = 8) -> list[str]:
    """The last log lines naming the task (file, real time, pid, event, message), in
    real-time order: a skewed incarnation's times are shown with its offset undone."""
    found: list[tuple[float, str]] = []
    needle = str(task_id)
    for inc in cluster.incarnations():
        name = inc.log.name + (f" (clock {inc.skew_s:+d}s)" if inc.skew_s else "")
        with suppress(OSError):
            for line in inc.log.read_text(errors="replace").splitlines():
                if needle in line:
                    found.append(_brief(line, name, inc))
    return [f"    {text}" for _at, text in sorted(found)[-limit:]]


def _brief(line: str, name: str, inc: Incarnation) -> tuple[float, str]:
    try:
        record = json.loads(line)
        at = logscan.real_time(record, inc, 0.0)
    except (ValueError, KeyError, TypeError):
        return 0.0, f"{name}: {line[:200]}"
    message = str(record.get("message") or record.get("error") or "")[:160]
    shown = datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")
    return at, f"{name}: {shown} pid {record.get('pid')} {record.get('event')} {message}"
