"""Faults an operator makes with Celery's own command line, run against the soak's broker
the way a platform team runs them (``celery -A tasks ...`` with the cluster's
configuration variables, as every soak process gets them).

- ``purge``: ``celery -A tasks purge -f -Q exports,reminders``. The messages waiting in
  the queues are gone while their runs stay WAITING and published: only the broker shows
  it. The dispatcher must see from the broker itself that the messages are missing (in
  neither the queue lists nor kombu's unacked hash, in two looks a scan apart:
  tasks/broker_view.py) and publish those runs again within two scans. The fault waits
  (up to ``PURGE_WAIT_S``) for a message to wait in the queues, reads them just before
  the command (which runs, with which stamp), leaves out those a worker took meanwhile
  (in kombu's unacknowledged hash right after the command: not purged), and then watches
  the ledger until each of the others goes again: re-published (a new stamp), claimed, or
  ended.
- ``revoke``: ``celery -A tasks control revoke <task_id>-<run>`` (what Flower's revoke
  button sends), or half the time ``celery -A tasks control terminate SIGTERM
  <task_id>-<run>`` (the command line's spelling of revoke with terminate: the pool process
  running it is killed), for a run of the workload that the ledger shows WAITING and
  published, or RUNNING. Revoke is a cancel: the run must end CANCELLED (the revoke met
  it) or COMPLETED (it had completed, or its execution went on: a revoke without terminate
  does not stop a running task); never stay WAITING or RUNNING. Only runs of cases that
  expect COMPLETED run 0 are revoked (``export``, ``reminder``, ``scheduled``), so the
  other cases' own expectations stay as they are. When none of them is WAITING-published
  or RUNNING for ``PICK_WAIT_S`` (the end of the window: the workload has drained), the
  fault creates an export of its own (case ``spare``) and revokes that once it is
  published. The command takes about a second to start, longer than most runs take, so
  a terminate aimed at a RUNNING run of the workload mostly finds it completed: half the
  terminates (a quarter of the revoke faults) therefore create their own ``spare`` export
  marked ``slow`` (a 2 s pause at its first batch, soak/hooks.py) and terminate it once
  the ledger shows it RUNNING: the pool process running it is killed mid-export.

Both send their command once the previous Redis fault has ended (one Redis fault at a
time, soak/outages.py): a command that cannot reach the broker proves nothing. Each
command's output goes to ``logs/tools.log``.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import uuid
from datetime import datetime
from typing import Any

import redis
import sqlalchemy as sa

from harness.processes import ROOT, celery_argv
from soak import workload
from soak.chaos import Chaos, Purge, Record, Revoke
from soak.outages import LOCK_WAIT_S, _client
from tasks.names import EXPORTS_QUEUE, REMINDERS_QUEUE

QUEUES = (EXPORTS_QUEUE, REMINDERS_QUEUE)
COMMAND_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 2.0  # control commands wait this long for the workers' replies
PURGED = re.compile(r"Purged (\d+) message")
PURGE_POLL_S = 0.25
PURGE_WAIT_S = 20.0  # for a message to wait in the queues (the workload comes in waves)
# How long the soak watches the purged runs. A run still waiting under its purged publish
# after PURGE_GOAL_S is a violation (soak/checks.py); the watch goes on longer only to say
# when it went after all (a queue the dispatcher could not list, longer than
# broker_view.LIST_LIMIT, falls back on LOST_AFTER: 60 s after its publish in the soak).
PURGE_WATCH_S = 75.0
# A purged run must be going again within this (soak/checks.py): the dispatcher leaves a
# run stamped less than 5 s ago alone (its publish may be under way) and then needs two
# looks a scan (1 s) apart; the rest is room for a dispatcher or PostgreSQL restart that
# another fault makes at the same time. A run published again only past LOST_AFTER (the
# rule where the broker cannot list its messages) takes 60 s from its publish.
PURGE_GOAL_S = 20.0
REVOCABLE_CASES = ("export", "reminder", "scheduled", "spare")
PICK_WAIT_S = 10.0  # for a run of the workload to be WAITING-published or RUNNING
SPARE_WAIT_S = 30.0  # for the fault's own export to be published
# for its own slow export to run: behind the workload's backlog (up to a minute and a half
# in the middle of a full soak's window)
SPARE_RUNNING_WAIT_S = 150.0
PICK_POLL_S = 0.1

CANDIDATES = sa.text("""
    SELECT id, run, status, dispatched_at FROM background_tasks
     WHERE id = ANY(CAST(:ids AS uuid[])) AND run = 0
       AND (status = 'RUNNING' OR (status = 'WAITING' AND dispatched_at IS NOT NULL))
""")
RUN_STATES = sa.text("""
    SELECT id, run, status, dispatched_at FROM background_tasks
     WHERE id = ANY(CAST(:ids AS uuid[]))
""")

# The first claim of any run after :since (epoch seconds, the database's clock): the first
# evidence, after a purge, that some worker consumes again.
FIRST_CLAIM_SINCE = sa.text("""
    SELECT extract(epoch FROM min(at)) FROM task_audit
     WHERE event = 'CLAIM' AND at > to_timestamp(:since)
""")


def run_command(chaos: Chaos, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tasks <args>`` with the cluster's environment; logged to tools.log."""
    done = subprocess.run(
        celery_argv(*args),
        env=chaos.cluster.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    with (chaos.cluster.logdir / "tools.log").open("a") as log:
        log.write(f"$ celery -A tasks {' '.join(args)}  (exit {done.returncode})\n")
        log.write(done.stdout + done.stderr + "\n")
    return done


# ---- purge ----------------------------------------------------------------------------------
def purge(chaos: Chaos, record: Record) -> None:
    record.detail = f"celery purge -f -Q {','.join(QUEUES)}"
    chaos.later(_purge_when_waiting, chaos, record)


def _purge_when_waiting(chaos: Chaos, record: Record) -> None:
    """Once a message waits in the queues (or after PURGE_WAIT_S), purge: a purge of
    empty queues tests nothing. The command itself starts in about a second, so it may
    still find them empty."""
    deadline = time.monotonic() + PURGE_WAIT_S
    while time.monotonic() < deadline:
        try:
            if _waiting_count(chaos) > 0:
                break
        except redis.RedisError:
            pass  # Redis restarting: look again
        time.sleep(PICK_POLL_S)
    waited = PURGE_WAIT_S - (deadline - time.monotonic())
    if waited >= 0.1:
        record.detail += f" (waited {waited:.1f}s for a waiting message)"
    if not chaos.redis_lock.acquire(timeout=LOCK_WAIT_S):
        record.detail = f"skipped: the previous Redis fault still runs; {record.detail}"
        return
    try:
        _purge(chaos, record)
    finally:
        chaos.redis_lock.release()


def _waiting_count(chaos: Chaos) -> int:
    client = _client(chaos)
    prefix = chaos.cluster.env["QUEUE_PREFIX"]
    try:
        return sum(int(client.llen(f"{prefix}:{queue}")) for queue in QUEUES)
    finally:
        client.close()


def _purge(chaos: Chaos, record: Record) -> None:
    try:
        waiting = _waiting_runs(chaos)
    except redis.RedisError as exc:
        record.detail = f"skipped: Redis did not answer ({type(exc).__name__})"
        return
    found = Purge(chaos.timeline.now(), runs=waiting)
    try:
        done = run_command(chaos, "purge", "-f", "-Q", ",".join(QUEUES))
    except subprocess.TimeoutExpired:
        done = None
    chaos.purges.append(found)  # the command may have purged even if it failed after
    try:
        # A message a worker took between the look and the purge was not purged: it waits
        # in the worker (kombu's unacknowledged hash), or was claimed.
        for key in _unacked_runs(chaos):
            found.runs.pop(key, None)
    except redis.RedisError:
        pass
    chaos.timeline.event("purge", found.at, f"{len(waiting)} runs waiting")
    if done is None or done.returncode != 0:
        code = "timeout" if done is None else f"exit {done.returncode}"
        record.detail = (
            f"skipped: {record.detail}: the command failed ({code}); "
            f"{len(waiting)} runs were waiting"
        )
    else:
        match = PURGED.search(done.stdout)
        found.purged = int(match.group(1)) if match else 0
        record.detail += f": {found.purged} messages purged, {len(waiting)} runs were waiting"
    chaos.later(_watch_purged, chaos, record, found)


def _waiting_runs(chaos: Chaos) -> dict[tuple[uuid.UUID, int], datetime]:
    """The runs whose message waits in the task queues now, with its publish's stamp."""
    client = _client(chaos)
    prefix = chaos.cluster.env["QUEUE_PREFIX"]
    try:
        raw: list[Any] = []
        for queue in QUEUES:
            raw += client.lrange(f"{prefix}:{queue}", 0, -1)
    finally:
        client.close()
    runs: dict[tuple[uuid.UUID, int], datetime] = {}
    for item in raw:
        found = _message_run(item)
        if found is not None:
            runs[(found[0], found[1])] = found[2]
    return runs


def _unacked_runs(chaos: Chaos) -> set[tuple[uuid.UUID, int]]:
    """The runs whose message a worker holds unacknowledged now (kombu's hash)."""
    client = _client(chaos)
    prefix = chaos.cluster.env["QUEUE_PREFIX"]
    try:
        entries = client.hvals(f"{prefix}:unacked")
    finally:
        client.close()
    held = set()
    for entry in entries:
        found = _unacked_run(entry)
        if found is not None:
            held.add((found[0], found[1]))
    return held


def held_messages(
    client: redis.Redis, prefix: str, task_id: uuid.UUID, run: int
) -> list[tuple[str, datetime]]:
    """Where the broker holds a message of this run now, read in one MULTI as the
    dispatcher's look reads it (tasks/broker_view.py): ``(queue, stamp)`` for each one
    waiting in a task queue's list, ``("unacked", stamp)`` for each one a worker took and
    has not acknowledged (kombu's hash). Raises redis.RedisError."""
    key = (uuid.UUID(str(task_id)), run)
    with client.pipeline(transaction=True) as pipe:
        for queue in QUEUES:
            pipe.lrange(f"{prefix}:{queue}", 0, -1)
        pipe.hvals(f"{prefix}:unacked")
        *lists, entries = pipe.execute()
    held: list[tuple[str, datetime]] = []
    for queue, items in zip(QUEUES, lists, strict=True):
        for item in items:
            found = _message_run(item)
            if found is not None and found[:2] == key:
                held.append((queue, found[2]))
    for entry in entries:
        found = _unacked_run(entry)
        if found is not None and found[:2] == key:
            held.append(("unacked", found[2]))
    return held


def _unacked_run(entry: Any) -> tuple[uuid.UUID, int, datetime] | None:
    """``(task_id, run, stamp)`` of kombu's unacked entry ``[message, exchange, routing
    key]``, when its message is one of the dispatcher's."""
    try:
        message = json.loads(entry)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return _message_run(json.dumps(message))


def _message_run(raw: Any) -> tuple[uuid.UUID, int, datetime] | None:
    """``(task_id, run, stamp)`` of one of the dispatcher's messages (kombu's envelope)."""
    try:
        message = json.loads(raw)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        task_id, run, stamp = json.loads(body)[0]
        return uuid.UUID(str(task_id)), int(run), datetime.fromisoformat(str(stamp))
    except (ValueError, TypeError, KeyError, IndexError):
        return None


def _watch_purged(chaos: Chaos, record: Record, found: Purge) -> None:
    """Until each purged run goes again (or PURGE_WATCH_S): seconds after the purge, or
    after the first claim of any run that followed it when that came later. The
    dispatcher publishes only into queues a live worker consumes (docs/design.md,
    "Dispatch"), and the soak's own faults can leave none for a while (every worker
    killed, draining a long export or frozen): a purged run is late only when workers
    were consuming again and it still did not go."""
    pending = dict(found.runs)
    found.resumed_s = dict.fromkeys(found.runs)
    ids = [str(task_id) for task_id, _run in pending]
    consumed_at: float | None = None
    while pending and chaos.timeline.now() - found.at < PURGE_WATCH_S:
        try:
            with chaos.engine.connect() as conn:
                rows = {r.id: r for r in conn.execute(RUN_STATES, {"ids": ids})}
                if consumed_at is None:
                    first = conn.execute(FIRST_CLAIM_SINCE, {"since": found.at}).scalar()
                    consumed_at = None if first is None else float(first)
        except sa.exc.DBAPIError:
            rows = None  # PostgreSQL restarting: look again
        now = chaos.timeline.now()
        start = found.at if consumed_at is None else max(found.at, consumed_at)
        for key, stamp in list(pending.items()):
            row = rows.get(key[0]) if rows is not None else None
            if row is None:
                continue
            if (row.run, row.status, row.dispatched_at) != (key[1], "WAITING", stamp):
                found.resumed_s[key] = round(max(0.0, now - start), 2)
                found.resumed_at[key] = now
                del pending[key]
        time.sleep(PURGE_POLL_S)
    gone = [s for s in found.resumed_s.values() if s is not None]
    record.detail += (
        f"; {len(gone)} going again within {max(gone):.1f}s" if gone else "; none to watch"
    )
    if pending:
        record.detail += f", {len(pending)} not within {PURGE_WATCH_S:.0f}s"


# ---- revoke ---------------------------------------------------------------------------------
def revoke(chaos: Chaos, record: Record) -> None:
    # Drawn now, in the injector's thread, so the seed decides them.
    terminate = record.rng.random() < 0.5
    prefer_running = record.rng.random() < 0.5
    own = terminate and record.rng.random() < 0.5
    record.detail = "control terminate SIGTERM" if terminate else "control revoke"
    chaos.later(_revoke, chaos, record, terminate, prefer_running, own)


def _revoke(chaos: Chaos, record: Record, terminate: bool, prefer_running: bool, own: bool) -> None:
    """Pick the run, then send the command once no other Redis fault runs."""
    if own:  # a terminate that surely meets a running execution
        picked, spare = _spare(chaos, slow=True), " (the fault's own slow export)"
    else:
        picked, spare = _pick(chaos, prefer_running, PICK_WAIT_S, _revocable(chaos)), ""
        if picked is None:
            picked, spare = _spare(chaos, slow=False), " (the fault's own export)"
    if picked is None:
        record.detail = f"skipped: {record.detail}: no run WAITING-published or RUNNING{spare}"
        return
    if not chaos.redis_lock.acquire(timeout=LOCK_WAIT_S):
        record.detail = f"skipped: {record.detail}: the previous Redis fault still runs"
        return
    try:
        _send_revoke(chaos, record, terminate, picked, spare)
    finally:
        chaos.redis_lock.release()


def _send_revoke(
    chaos: Chaos,
    record: Record,
    terminate: bool,
    picked: tuple[uuid.UUID, int, str],
    spare: str,
) -> None:
    task_id, run, status = picked
    message = f"{task_id}-{run}"
    entry = Revoke(task_id, run, status, terminate, chaos.timeline.now())
    chaos.revokes.append(entry)  # before the command: it may reach a worker and then fail
    args = ("terminate", "SIGTERM") if terminate else ("revoke",)
    try:
        done = run_command(chaos, "control", *args, message, "-t", str(REPLY_TIMEOUT_S), "-j")
    except subprocess.TimeoutExpired:
        done = None
    chaos.timeline.event("revoke", entry.issued_at, f"{message} ({status})")
    what = f"{record.detail} {str(task_id)[:8]}-{run} ({status}){spare}"
    if done is None or done.returncode != 0:
        code = "timeout" if done is None else f"exit {done.returncode}"
        entry.command = f"failed ({code})"
        record.detail = f"skipped: {what}: the command failed ({code})"
        return
    entry.command = _replies(done.stdout, message)
    record.detail = f"{what}: {entry.command}"


def _revocable(chaos: Chaos) -> list[workload.TaskPlan]:
    with chaos.revoke_lock:
        revoked = {r.task_id for r in chaos.revokes} | chaos.revoke_picked
    return [
        p
        for p in chaos.plans
        if p.case in REVOCABLE_CASES
        and p.task_id is not None
        and p.task_id not in revoked
        and not (p.case == "spare" and p.mark == "slow")  # a terminate's or a poolkill's own
    ]


def _pick(
    chaos: Chaos,
    prefer_running: bool,
    wait_s: float,
    plans: list[workload.TaskPlan],
    running_only: bool = False,
) -> tuple[uuid.UUID, int, str] | None:
    """A run among ``plans`` the ledger shows WAITING-published or RUNNING (waits up to
    ``wait_s`` for one); RUNNING ones first when ``prefer_running``. The command takes about
    a second to start and most runs take less than that, so of each state the one likely
    to be reached in time: the RUNNING export with the most rows, the WAITING run published
    last (the queues are first in, first out)."""
    deadline = time.monotonic() + wait_s
    ids = [str(p.task_id) for p in plans]
    rows_of = {p.task_id: p.rows or 0 for p in plans}
    while ids:
        try:
            with chaos.engine.connect() as conn:
                rows = sorted(conn.execute(CANDIDATES, {"ids": ids}), key=lambda r: str(r.id))
        except sa.exc.DBAPIError:
            rows = []  # PostgreSQL restarting: look again
        running = [r for r in rows if r.status == "RUNNING"]
        waiting = [r for r in rows if r.status == "WAITING" and not running_only]
        running.sort(key=lambda r: rows_of.get(r.id, 0), reverse=True)
        waiting.sort(key=lambda r: r.dispatched_at, reverse=True)
        first, second = (running, waiting) if prefer_running else (waiting, running)
        with chaos.revoke_lock:  # two revoke faults may pick at once: each its own run
            chosen = [r for r in first or second if r.id not in chaos.revoke_picked]
            if chosen:
                chaos.revoke_picked.add(chosen[0].id)
                return chosen[0].id, int(chosen[0].run), str(chosen[0].status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(PICK_POLL_S)
    return None


def _spare(chaos: Chaos, slow: bool) -> tuple[uuid.UUID, int, str] | None:
    """Create one of the fault's own exports and pick it once it is published; a ``slow``
    one (soak/hooks.py: it pauses 2 s at its first batch) once it is RUNNING."""
    supply = chaos.supply.get("spare", [])
    if not supply:
        return None
    plan = supply.pop(0)
    plan.mark = "slow" if slow else None
    workload.submit(chaos.engine, chaos.gate, plan)
    if plan.task_id is None:
        return None
    wait_s = SPARE_RUNNING_WAIT_S if slow else SPARE_WAIT_S
    return _pick(chaos, slow, wait_s, [plan], running_only=slow)


def _replies(out: str, message: str) -> str:
    """The workers' replies to a control command, briefly (the message id as "<id>")."""
    try:
        replies = json.loads(out)
    except ValueError:
        return f"answer {out.strip()[:120]!r}"
    if isinstance(replies, list):
        replies = {k: v for reply in replies for k, v in reply.items()}
    if not isinstance(replies, dict):
        return f"answer {str(replies)[:120]!r}"
    said = sorted({str(v.get("ok", v) if isinstance(v, dict) else v) for v in replies.values()})
    text = "; ".join(said).replace(f"{{'{message}'}}", "<id>").replace(message, "<id>")
    return f"{len(replies)} workers replied: {text[:160]}"
