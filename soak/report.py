"""What the soak prints after its checks: counts, notes and each violation with the task's
audit trail and the worker log lines naming it. Everything also goes to ``report.txt``."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from soak import checks, faults, workload
from soak.cluster import Cluster

REPORT_LIMIT = 40  # violations printed with their details (all of them go to report.txt)
LOGGED_EVENTS = (
    "task.lease_lost",
    "task.stalled",
    "task.skipped",
    "task.attempt_failed",
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
        injector: faults.Injector,
        operator: workload.Operator,
    ) -> None:
        cases = Counter(p.case for p in plans)
        kinds = Counter(r.kind for r in injector.records if not r.detail.startswith("skipped"))
        cancels = Counter(p.cancel_outcome for p in plans if p.case.startswith("cancel_"))
        self.say(f"soak: cases {dict(sorted(cases.items()))}")
        self.say(f"soak: faults {dict(sorted(kinds.items()))}; cancels {dict(cancels)}")
        self.say(f"soak: SIGTERM exit codes {dict(Counter(injector.term_exit_codes))}")
        self.say(f"soak: ledger {checks.stats(self.engine)}")
        self.say(f"soak: worker logs {log_counts(self.cluster)}")
        for member in self.cluster.members.values():
            if member.unexpected_exits:
                self.say(
                    f"soak: note: {member.name} exited on its own {len(member.unexpected_exits)} "
                    f"times (incarnation, rc) {member.unexpected_exits}; restarted like a "
                    f"process manager would"
                )
        for error in operator.errors[:5]:
            self.say(f"soak: note: user action error {error}")
        (self.workdir / "faults.txt").write_text(
            "\n".join(r.line() for r in injector.records) + "\n"
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


def log_counts(cluster: Cluster) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for member in cluster.members.values():
        for path in member.logs:
            with suppress(OSError):
                text = path.read_text(errors="replace")
                for event in LOGGED_EVENTS:
                    counts[event] += text.count(f'"event": "{event}"')
                counts["fatal"] += text.count('"level": "fatal"')
    return dict(counts)


def log_lines(cluster: Cluster, task_id: uuid.UUID, limit: int = 8) -> list[str]:
    """The last worker log lines naming the task (file name, time, pid, event, message)."""
    found: list[tuple[str, str]] = []
    for member in cluster.members.values():
        for path in member.logs:
            with suppress(OSError):
                for line in path.read_text(errors="replace").splitlines():
                    if str(task_id) in line:
                        found.append(_brief(line, path.name))
    return [f"    {name}: {text}" for text, name in sorted(found)[-limit:]]


def _brief(line: str, name: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
    except ValueError:
        return line[:200], name
    message = str(record.get("message") or record.get("error") or "")[:160]
    return f"{record.get('time')} pid {record.get('pid')} {record.get('event')} {message}", name
