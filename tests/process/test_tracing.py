"""One trace from the API to the worker (docs/design.md, "Tracing"; teamdesk/tracing.py):
a real API, beat and worker, configured by the standard ``OTEL_*`` variables only,
export over OTLP/HTTP to a receiver the test starts.

An export created through the API is one trace: the API's request span, the dispatcher's
publish (its child, through the ledger row's ``trace_parent``), the worker's execution (the
publish's child, through the message's header) with its claim, read and completion as events; the
worker's log lines carry the trace's ids. A retry opens a new trace linked to the run
before it. Tracing off (every other process test) stores nothing and sends nothing.
"""

from __future__ import annotations

import functools
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from harness.factories import World, add_ticket, audit_trail, insert_task, task_row
from harness.otlp_receiver import ReceivedSpan, start_receiver
from harness.processes import Proc, celery_argv, cluster, free_port, settings_env, worker_argv
from harness.waiting import wait_for
from ledger import service
from ledger.tokens import create_token
from teamdesk.config import Settings
from tests.support.http_calls import call

pytestmark = pytest.mark.slow

PRODUCER, CONSUMER, SERVER = 4, 5, 2  # OTLP span kinds
# A run before the retry, in a trace of its own (a traceparent as the ledger stores it).
EARLIER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
EARLIER_PARENT = f"00-{EARLIER_TRACE}-00f067aa0ba902b7-01"
# An idle worker stops in ~3-4 s; the flush adds 2 s at most per child (FLUSH_TIMEOUT_S).
# Unbounded, the exporter's own 10 s timeout held it: 11.8 s measured.
STOP_BOUND_S = 8.0
CLIENT_TRACE = "33333333333333333333333333333333"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-2222222222222222-00"  # sampled: no


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans if span.trace_id == trace_id}


def one_trace_with(spans: list[ReceivedSpan], task_id: str, names: set[str]) -> str | None:
    """The trace holding the execution of ``task_id`` and every span of ``names``."""
    for span in spans:
        ours = span.attributes.get("teamdesk.task_id") == task_id and span.kind == CONSUMER
        if ours and names <= set(of_trace(spans, span.trace_id)):
            return span.trace_id
    return None


def an_export(engine: sa.Engine, world: World) -> uuid.UUID:
    """A WAITING team export of one ticket, created through the ledger (untraced)."""
    with engine.begin() as conn:
        add_ticket(conn, world.team_id, world.customer_id, "Printer")
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def run_to_completion(
    procs: list[Proc],
    env: dict[str, str],
    settings: Settings,
    engine: sa.Engine,
    task_id: uuid.UUID,
    tmp_path: Path,
) -> Proc:
    """A worker with ``env`` and an untraced beat, until ``task_id`` completed; the worker."""
    worker = Proc("worker", worker_argv("w", concurrency=1), env, tmp_path).start()
    procs += [worker, Proc("beat", celery_argv("beat"), settings_env(settings), tmp_path).start()]
    wait_for(
        lambda: task_row(engine, task_id)["status"] == "COMPLETED", timeout=60, what="completion"
    )
    return worker


def test_an_export_created_through_the_api_is_one_trace_and_a_retry_links_to_it(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        add_ticket(conn, world.team_id, world.customer_id, "Printer")
        token = create_token(conn, world.staff_id, "tracing test")
        failed = insert_task(conn, world, status="FAILED")
        conn.execute(
            sa.text("UPDATE background_tasks SET trace_parent = :p WHERE id = :id"),
            {"p": EARLIER_PARENT, "id": failed},
        )
    receiver = start_receiver()
    env = settings_env(
        settings,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: spans leave each process promptly
        OTEL_TRACES_SAMPLER="parentbased_always_on",
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api_argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    names = {
        "POST /api/teams/{team_id}/exports",
        "publish teamdesk.export",
        "execute teamdesk.export",
    }
    try:
        with cluster(tmp_path) as procs:
            worker = Proc("worker", worker_argv("w", concurrency=1), env, tmp_path).start()
            procs += [
                Proc("api", api_argv, env, tmp_path).start(),
                worker,
                Proc("beat", celery_argv("beat"), env, tmp_path).start(),
            ]
            wait_for(lambda: call(base, "GET", "/api/health")[0] == 200, timeout=60, what="API")
            # A client's own context, not sampled: the API must neither continue it nor
            # let it switch the trace off.
            status, export = call(
                base,
                "POST",
                f"/api/teams/{world.team_id}/exports",
                token,
                {"scope": "TEAM"},
                headers={"traceparent": CLIENT_PARENT},
            )
            assert status == 201, export
            status, retried = call(base, "POST", f"/api/tasks/{failed}/retry", token)
            assert status == 202, retried

            def completed(task_id: object) -> bool:
                return task_row(engine, uuid.UUID(str(task_id)))["status"] == "COMPLETED"

            for task in (export["id"], failed):
                wait_for(functools.partial(completed, task), timeout=60, what="completion")
            found = functools.partial(one_trace_with, task_id=export["id"], names=names)
            wait_for(lambda: found(receiver.received()), timeout=30, what="the export's trace")
            retry_names = {"task.retry", "publish teamdesk.export", "execute teamdesk.export"}
            again = functools.partial(one_trace_with, task_id=str(failed), names=retry_names)
            wait_for(lambda: again(receiver.received()), timeout=30, what="the retry's trace")
            worker_log = worker.output()
    finally:
        receiver.close()
    spans = receiver.received()

    trace_id = found(spans)
    assert trace_id is not None
    trace = of_trace(spans, trace_id)
    request = trace["POST /api/teams/{team_id}/exports"]
    publish, execute = trace["publish teamdesk.export"], trace["execute teamdesk.export"]
    assert (request.service, request.kind, request.parent_id) == ("teamdesk-api", SERVER, "")
    assert CLIENT_TRACE not in {span.trace_id for span in spans}
    assert (publish.service, publish.kind) == ("teamdesk-dispatcher", PRODUCER)
    assert (execute.service, execute.kind) == ("teamdesk-worker", CONSUMER)
    # The row carried the creation's context to the dispatcher; the message, the publish's
    # to the worker; the execution's steps are its children.
    assert publish.parent_id == request.span_id  # the creation ran in the request's span
    assert {s.name for s in spans if s.service == "teamdesk-api"} == {
        "POST /api/teams/{team_id}/exports",
        "POST /api/tasks/{task_id}/retry",
        "task.retry",
    }  # no span of the probes, nor of the ASGI messages
    assert execute.parent_id == publish.span_id
    # Its steps are events of the execution, in order.
    assert execute.events == (
        ("claimed", {}),
        ("export.read", {"teamdesk.rows": 1}),
        ("export.completed", {}),
    )
    assert set(trace) == names  # the whole trace
    row = task_row(engine, uuid.UUID(export["id"]))
    assert row["trace_parent"].split("-")[1] == trace_id
    assert publish.attributes["teamdesk.task_id"] == export["id"]
    assert execute.attributes == {
        "teamdesk.task_id": export["id"],
        "teamdesk.run": 0,
        "teamdesk.execution_id": dict(audit_trail(engine, row["id"]))["COMPLETE"],
        "teamdesk.team_id": str(world.team_id),
        "teamdesk.task_kind": "EXPORT",
        "teamdesk.attempt": 1,
        "teamdesk.outcome": "completed",
    }
    # The worker's lines of that execution carry the trace's ids.
    lines = [json.loads(line) for line in worker_log.splitlines() if line.startswith("{")]
    started = [line for line in lines if line.get("event") == "task.started"]
    ours = [line for line in started if line.get("task_id") == export["id"]]
    assert [(line["trace_id"], line["span_id"]) for line in ours] == [(trace_id, execute.span_id)]

    # The retry's run: a new trace (the retry request's), linked to the run before it.
    retry_trace = of_trace(spans, again(spans) or "")
    assert retry_trace["task.retry"].links == (EARLIER_TRACE,)
    assert retry_trace["execute teamdesk.export"].attributes["teamdesk.run"] == 1
    assert task_row(engine, failed)["trace_parent"].split("-")[1] == again(spans)
    assert all(span.status_code != 2 for span in spans), [s for s in spans if s.status_code == 2]


PUBLISH_SCRIPT = """
import json, sys, uuid
from datetime import UTC, datetime
from opentelemetry import trace
from ledger.dispatch import RunRef
from tasks.celery import app
from tasks.queueing import publish_batch
from teamdesk import tracing_setup

assert tracing_setup.configure("dispatcher")
now = datetime.now(UTC)
ids, parent = json.loads(sys.argv[1]), sys.argv[2]
publish_batch(app, [
    RunRef(uuid.UUID(ids[0]), 0, "EXPORT", stamp=now, trace_parent=parent),
    RunRef(uuid.UUID(ids[1]), 2, "EXPORT", stamp=now, trace_parent=parent, recovered=True),
    RunRef(uuid.UUID(ids[2]), 0, "REMINDER", stamp=now),
])
assert trace.get_tracer_provider().force_flush(10_000)
"""


def test_a_recovered_run_and_an_untraced_one_start_traces_of_their_own(
    settings: Settings,
) -> None:
    """The dispatcher's publish continues the row's trace; a recovered run's starts a new
    trace linked to it (its first execution's trace stays as it ended); a run whose row
    holds no context (created while tracing was off) starts one of its own."""
    ids = [str(uuid.uuid4()) for _ in range(3)]
    receiver = start_receiver()
    try:
        env = settings_env(settings, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
        done = subprocess.run(
            [sys.executable, "-c", PUBLISH_SCRIPT, json.dumps(ids), EARLIER_PARENT],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        spans = {span.attributes["teamdesk.task_id"]: span for span in receiver.received()}
    finally:
        receiver.close()
    joined, recovered, untraced = (spans[task_id] for task_id in ids)
    assert (joined.trace_id, joined.parent_id, joined.links) == (
        EARLIER_TRACE,
        EARLIER_PARENT.split("-")[2],
        (),
    )
    assert recovered.trace_id != EARLIER_TRACE and recovered.parent_id == ""
    assert recovered.links == (EARLIER_TRACE,)
    assert recovered.attributes["teamdesk.recovered"] is True
    assert (untraced.parent_id, untraced.links, untraced.name) == (
        "",
        (),
        "publish teamdesk.reminder",
    )
    assert len({joined.trace_id, recovered.trace_id, untraced.trace_id}) == 3
    assert {span.kind for span in spans.values()} == {PRODUCER}


def test_a_pool_process_exports_its_last_spans_before_it_exits(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    """Billiard ends a pool process with ``os._exit`` (no ``atexit``): the spans still in
    its batch would be lost at every deploy. The worker flushes them as the child exits;
    here the batch never leaves on its own (a ten-minute schedule), only that flush can
    send it."""
    task_id = an_export(engine, world)
    receiver = start_receiver()
    try:
        env = settings_env(
            settings,
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="600000",
        )
        with cluster(tmp_path) as procs:
            worker = run_to_completion(procs, env, settings, engine, task_id, tmp_path)
            assert not [s for s in receiver.received() if s.service == "teamdesk-worker"]
            worker.send(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0
        executed = [s for s in receiver.received() if s.name == "execute teamdesk.export"]
    finally:
        receiver.close()
    assert [s.attributes["teamdesk.task_id"] for s in executed] == [str(task_id)]
    assert executed[0].attributes["teamdesk.outcome"] == "completed"


BAD_HEADER_SCRIPT = """
import sys, uuid
from datetime import UTC, datetime
from opentelemetry import trace
from ledger.dispatch import RunRef
from tasks.celery import app
from tasks.queueing import publish_batch
from teamdesk import tracing, tracing_setup
from teamdesk.db import get_engine
from sqlalchemy import text

assert tracing_setup.configure("dispatcher")
tracing.current_parent = lambda: 123  # a header of another type than a traceparent
task_id = uuid.UUID(sys.argv[1])
with get_engine().begin() as conn:
    stamp = conn.execute(
        text("UPDATE background_tasks SET dispatched_at = now() WHERE id = :id"
             " RETURNING dispatched_at"), {"id": task_id}).scalar_one()
publish_batch(app, [RunRef(task_id, 0, "EXPORT", stamp=stamp)])
"""


def test_a_header_that_is_no_traceparent_starts_a_trace_and_fails_nothing(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    """A message whose ``traceparent`` header is not even text (an integer) runs as any
    other, in a trace of its own; it failed the delivery before it touched the ledger."""
    task_id = an_export(engine, world)
    receiver = start_receiver()
    try:
        env = settings_env(
            settings, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="100"
        )
        with cluster(tmp_path) as procs:
            worker = Proc("worker", worker_argv("w", concurrency=1), env, tmp_path).start()
            procs.append(worker)
            worker.wait_event("worker.started", timeout=60)
            done = subprocess.run(
                [sys.executable, "-c", BAD_HEADER_SCRIPT, str(task_id)],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            wait_for(
                lambda: task_row(engine, task_id)["status"] == "COMPLETED",
                timeout=60,
                what="completion",
            )

            def executed() -> list[ReceivedSpan]:
                return [s for s in receiver.received() if s.name == "execute teamdesk.export"]

            wait_for(executed, timeout=30, what="the execution's span")
            failures = worker.events("task.failed")
    finally:
        receiver.close()
    [execute] = executed()
    assert (execute.parent_id, execute.attributes["teamdesk.outcome"]) == ("", "completed")
    assert failures == [] and audit_trail(engine, task_id)[0][0] == "CLAIM"


@pytest.mark.alone  # a stop's time against a bound: a loaded machine's delay is the margin
def test_a_silent_collector_holds_a_pool_process_exit_two_seconds_at_most(
    engine: sa.Engine, world: World, settings: Settings, tmp_path: Path
) -> None:
    """The child's flush at exit is bounded (the SDK's own ignores its timeout and waits
    out the exporter's timeout and retries: with a collector that accepts and never
    answers a worker took 21-22 s to stop after SIGTERM, 3.1 s with a live one). The
    bound asserted leaves a loaded machine room."""
    task_id = an_export(engine, world)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel), never answers
    env = settings_env(
        settings,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}",
        OTEL_BSP_SCHEDULE_DELAY="600000",  # the spans wait for the exit's flush
    )
    with silent, cluster(tmp_path) as procs:
        worker = run_to_completion(procs, env, settings, engine, task_id, tmp_path)
        worker.send(signal.SIGTERM)
        stopping = time.monotonic()
        assert worker.wait(timeout=60) == 0
        took = time.monotonic() - stopping
    assert took < STOP_BOUND_S, took
