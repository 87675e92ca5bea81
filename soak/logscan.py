"""What the workers' logs say about each execution: which process ran it and when it ended.

The audit trail names executions, not processes. A worker logs ``task.started`` right
after its claim and one closing event when the execution ends (``task.completed``,
``task.skipped``, ``task.lease_lost``, ``task.cancelled``, ``task.failed``,
``task.attempt_failed``), each with
the task id and the execution id's first 8 characters, from the pool process that runs it
(``pid``). Every incarnation logs to its own file, unbuffered, so a process that lives logs
both; a killed one may lose the closing line, and then it is dead anyway.

An execution whose outcome an exception it did not catch replaced (Celery's "raised
unexpected") logs no closing event with its id; the queue's failure callback then logs
``task.failed`` (``source: queue``) with the task and run, from the same pool process: that
ends it. So does any later closing event of the same run from the same pool process (a
prefork pool process runs one message at a time).

One execution ends without a line of its own: ``celery control terminate`` (the ``revoke``
fault) has the worker's main process log ``Terminating <task>-<run>`` and kill the pool
process running it. An execution of that run, in that incarnation, started and not ended
by then ends there (``TERMINATED``): its process is dead from that moment.

Nor does one whose pool process died otherwise while the worker lived on: Celery's prefork
pool SIGKILLs a new pool process whose start message it did not read within 4 s ("Timed out
waiting for UP message", seen after its main process spent seconds reconnecting to the
broker during a Redis failover), and billiard then prints, without a time, ``Process
'ForkPoolWorker-3' pid:7018 exited with 'signal 9 (SIGKILL)'``. Every execution of that
incarnation in that pid, started and not ended by then, ends there (``POOL_EXITED``), at
the time of the next timed line of the file (the process was dead by then at the latest).

Nor does one whose pool process the ``poolkill`` fault SIGKILLed (or the OOM killer
would): its worker's main process sees the process gone and logs ``task.process_lost``
(task, run, execution, ``pool_pid``, ``exit``, ``outcome``: ``retry``, ``failed``,
``not_held`` or ``unreported``) with its own pid. That line ends the execution it names
(``PROCESS_LOST``) unless billiard's exit line ended it earlier, and every such line is
kept (``Logs.lost``) for the checks of the lost-process rule (soak/checks.py).
:class:`LogTail` reads one incarnation's log as it grows, for the fault itself: which
execution each pool process runs now, and the main process's reports.

Log times are the process's own clock: an incarnation started under ``faketime`` is read
back by its offset. The result is on the database's clock (the soak's host, whose clock
is PostgreSQL's, plus the offset measured at the start).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from soak.cluster import Incarnation

END_EVENTS = frozenset(
    {
        "task.completed",
        "task.skipped",
        "task.lease_lost",
        "task.cancelled",
        "task.failed",
        "task.attempt_failed",
    }
)
COLD_EVENTS = frozenset({"worker.shutdown_timeout"})
RECEIPT_SLACK_S = 0.5  # a receipt line may be written a moment after the claim it led to
TERMINATED = "terminated"  # an execution's end: its pool process killed by control terminate
# The main process logs "Terminating" once the pool has the job; the pool process may log
# its claim's task.started a moment later (and then die).
TERMINATE_SLACK_S = 1.0
POOL_EXITED = "pool process exited"  # an execution's end: its pool process died (billiard)
POOL_EXIT = re.compile(r"^Process '[^']*' pid:(\d+) exited with '([^']*)'")
LOST_EVENT = "task.process_lost"
PROCESS_LOST = "process lost"  # an execution's end: its main process reported its pool process lost


def killed(execution: Execution) -> bool:
    """Whether the execution ended because its process was killed (not by its own end)."""
    end = str(execution.end)
    return end == TERMINATED or end.startswith((POOL_EXITED, PROCESS_LOST))


@dataclass(frozen=True)
class ProcessLost:
    """One ``task.process_lost`` line: a worker's main process saw a pool process die while
    it ran an execution (worker/lost.py) and says what it wrote to the ledger."""

    at: float  # database clock
    process: str  # the incarnation ("w2.3")
    pid: int  # the process that logged it (the worker's main process)
    task_id: str
    run: int
    execution: str  # first 8 characters
    pool_pid: int | None
    exit: str  # "signal 9 (SIGKILL)"
    outcome: str  # retry, failed, not_held, unreported
    attempt: int | None  # retry and failed: the attempt that was lost

    @classmethod
    def of(cls, record: dict[str, Any], process: str, at: float) -> ProcessLost:
        pool_pid, attempt = record.get("pool_pid"), record.get("attempt")
        return cls(
            at,
            process,
            int(record.get("pid") or 0),
            str(record.get("task_id")),
            int(record.get("run", -1)),
            str(record.get("execution")),
            None if pool_pid is None else int(pool_pid),
            str(record.get("exit")),
            str(record.get("outcome")),
            None if attempt is None else int(attempt),
        )


@dataclass
class Execution:
    task_id: str
    execution: str  # the execution id's first 8 characters
    process: str  # the incarnation: "w2.3"
    pid: int  # the pool process that ran it
    started_at: float  # database clock, epoch seconds
    run: int = -1
    ended_at: float | None = None
    end: str | None = None  # the closing event


@dataclass
class Logs:
    executions: dict[tuple[str, str], Execution]  # (task id, execution) ->
    cold: dict[str, float]  # incarnation -> when it began to die (drain ran out, or a crash)
    members: dict[str, str]  # heartbeat member -> incarnation
    # message id ("<task>-<run>") -> (when, incarnation) of each delivery the worker logged
    # on receipt, before its claim: names the process of a claim killed before it logged
    receipts: dict[str, list[tuple[float, str]]]
    # (when, incarnation, message id) of every "Terminating <id>" (control terminate)
    terminations: list[tuple[float, str, str]] = field(default_factory=list)
    # (when at the latest, incarnation, pid, status) of every pool process billiard saw exit
    pool_exits: list[tuple[float, str, int, str]] = field(default_factory=list)
    # every task.process_lost line (a worker's main process reporting a lost pool process)
    lost: list[ProcessLost] = field(default_factory=list)

    def received_by(self, message: str, claimed_at: float) -> str | None:
        """The incarnation that received ``message`` last before ``claimed_at``."""
        before = [r for r in self.receipts.get(message, []) if r[0] <= claimed_at + RECEIPT_SLACK_S]
        return max(before)[1] if before else None


def records(inc: Incarnation) -> Iterator[dict[str, Any]]:
    try:
        text = inc.log.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def real_time(record: dict[str, Any], inc: Incarnation, offset_s: float) -> float:
    """The record's time on the database's clock (undoing the incarnation's faketime)."""
    logged = datetime.fromisoformat(str(record["time"]).replace("Z", "+00:00"))
    return logged.timestamp() - inc.skew_s + offset_s


def scan(incarnations: list[Incarnation], offset_s: float) -> Logs:
    logs = Logs({}, {}, {}, {})
    for inc in incarnations:
        for record in records(inc):
            _read(logs, inc, record, offset_s)
        logs.pool_exits += pool_exits(inc, offset_s)
    _terminate(logs)
    _pool_exited(logs)
    _process_lost(logs)
    return logs


def pool_exits(inc: Incarnation, offset_s: float) -> list[tuple[float, str, int, str]]:
    """billiard's ``Process '...' pid:N exited with '...'`` lines, each at the time of the
    next timed line (or of the last one, at the end of the file)."""
    try:
        lines = inc.log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found: list[tuple[float, str, int, str]] = []
    pending: list[tuple[int, str]] = []
    last: float | None = None
    for line in lines:
        match = POOL_EXIT.match(line)
        if match:
            pending.append((int(match.group(1)), match.group(2)))
            continue
        try:
            record = json.loads(line)
            last = real_time(record, inc, offset_s)
        except (ValueError, TypeError, KeyError):
            continue
        found += [(last, inc.name, pid, status) for pid, status in pending]
        pending = []
    if last is not None:
        found += [(last, inc.name, pid, status) for pid, status in pending]
    return found


def _pool_exited(logs: Logs) -> None:
    """End each execution whose pool process billiard saw exit."""
    for at, process, pid, status in logs.pool_exits:
        for found in logs.executions.values():
            if (
                (found.process, found.pid) == (process, pid)
                and found.started_at <= at
                and (found.ended_at is None or found.ended_at > at)
            ):
                found.ended_at, found.end = at, f"{POOL_EXITED} ({status})"


def _process_lost(logs: Logs) -> None:
    """End each execution its main process reported lost (unless it ended earlier:
    billiard's exit line, at the time of the next timed line, may come first)."""
    for lost in logs.lost:
        found = logs.executions.get((lost.task_id, lost.execution))
        if found is None or found.process != lost.process:
            continue
        if found.ended_at is None or found.ended_at > lost.at:
            found.ended_at, found.end = lost.at, f"{PROCESS_LOST} ({lost.outcome})"


def _ended_unnamed(logs: Logs, inc: Incarnation, record: dict[str, Any], at: float) -> None:
    """A closing event without an execution id, from the pool process that ran an execution
    of that run: the queue's failure callback (``task.failed``, ``source: queue``: the
    execution's own outcome was replaced by an exception it did not catch), or a later
    delivery of the run in the same process (a failed claim, a skip). A prefork pool
    process runs one message at a time, so the execution it ran before had ended."""
    task_id, run, pid = str(record["task_id"]), record.get("run"), int(record["pid"])
    for found in logs.executions.values():
        if (
            (found.task_id, found.process, found.pid) == (task_id, inc.name, pid)
            and (run is None or found.run == int(run))
            and found.ended_at is None
            and found.started_at <= at
        ):
            found.ended_at, found.end = at, f"{record['event']} (no execution id)"


def _terminate(logs: Logs) -> None:
    """End each execution a ``Terminating <task>-<run>`` line killed."""
    for at, process, message in logs.terminations:
        task_id, _, run = message.rpartition("-")
        for found in logs.executions.values():
            if (
                (found.task_id, str(found.run), found.process) == (task_id, run, process)
                and found.started_at <= at + TERMINATE_SLACK_S
                and (found.ended_at is None or found.ended_at > at)
            ):
                found.ended_at, found.end = at, TERMINATED


def _read(logs: Logs, inc: Incarnation, record: dict[str, Any], offset_s: float) -> None:
    event = record.get("event")
    if event == "worker.started" and record.get("member"):
        logs.members[str(record["member"])] = inc.name
    elif event in COLD_EVENTS or record.get("level") == "fatal":
        # Past its drain budget, or after "Unrecoverable error": the process is going down
        # and takes its work with it (the exit itself is judged on its own).
        logs.cold.setdefault(inc.name, real_time(record, inc, offset_s))
    elif event == "log" and str(record.get("message", "")).endswith("] received"):
        message = (record.get("data") or {}).get("id")
        if message:
            receipt = (real_time(record, inc, offset_s), inc.name)
            logs.receipts.setdefault(str(message), []).append(receipt)
    elif event == "log" and str(record.get("message", "")).startswith("Terminating "):
        words = str(record["message"]).split()
        if len(words) >= 2:
            logs.terminations.append((real_time(record, inc, offset_s), inc.name, words[1]))
    elif event == LOST_EVENT and "task_id" in record:
        logs.lost.append(ProcessLost.of(record, inc.name, real_time(record, inc, offset_s)))
        return
    execution = record.get("execution")
    if not execution and event in END_EVENTS and "task_id" in record and "pid" in record:
        _ended_unnamed(logs, inc, record, real_time(record, inc, offset_s))
    if not execution or "task_id" not in record:
        return
    key = (str(record["task_id"]), str(execution))
    at = real_time(record, inc, offset_s)
    if event == "task.started":
        logs.executions[key] = Execution(
            key[0], key[1], inc.name, int(record["pid"]), at, int(record.get("run", -1))
        )
    elif event in END_EVENTS and key in logs.executions:
        found = logs.executions[key]
        if found.ended_at is None:
            found.ended_at, found.end = at, str(event)


class LogTail:
    """One incarnation's log, read on as it grows (the ``poolkill`` fault): the execution
    each pool process runs now (``task.started`` and not yet a closing event from that
    pid) and the main process's ``task.process_lost`` records by pool pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.running: dict[int, tuple[str, str]] = {}  # pool pid -> (task id, execution)
        self.lost: dict[int, dict[str, Any]] = {}  # pool pid -> its task.process_lost record
        self.lock = threading.Lock()

    def read(self) -> None:
        with self.lock:
            try:
                with self.path.open("rb") as log:
                    log.seek(self.offset)
                    data = log.read()
            except OSError:
                return
            self.offset += len(data)
            lines = (self.partial + data).split(b"\n")
            self.partial = lines.pop()
            for line in lines:
                self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        event, pid = record.get("event"), record.get("pid")
        if event == "task.started" and pid is not None and record.get("execution"):
            self.running[int(pid)] = (str(record.get("task_id")), str(record["execution"]))
        elif event in END_EVENTS and pid is not None:
            self.running.pop(int(pid), None)
        elif event == LOST_EVENT and record.get("pool_pid") is not None:
            self.lost[int(record["pool_pid"])] = record
