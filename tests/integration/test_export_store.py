"""Exports kept in an S3-compatible object store (EXPORT_STORE=s3://...; issue "Export
artifacts off the primary"), against a real S3 API server (moto's, over HTTP on
127.0.0.1: tests/support/s3.py) reached through the standard AWS variables.

The worker uploads while its read streams (a multipart upload, parts sent as the COPY goes
on), under a key of its own execution; the fenced completion names the object; the API
streams it or redirects to a presigned URL; a late execution's upload and a refused one
are removed; the dispatcher's purge removes expired CSVs' objects, orphans and uploads a
crash left open, judged by the database's clock."""

from __future__ import annotations

import hashlib
import re
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from celery import Celery

from dispatcher import objects
from dispatcher import scan as scan_module
from dispatcher.context import Cluster
from dispatcher.window import Window
from harness.csv_reference import expected_csv
from harness.factories import World, add_tickets, audit_events, task_row
from harness.processes import free_port, settings_env
from harness.waiting import wait_for
from ledger import artifacts, lease, service
from teamdesk import export_store, hooks, s3_store
from teamdesk.config import Settings, get_settings
from tests.support.api_helpers import api_client, bearer, make_tokens
from tests.support.dispatching import running_cluster
from tests.support.s3 import S3Server, s3_environment, s3_server
from tests.support.tcp_proxy import tcp_proxy

PART_BYTES = 5 << 20  # S3's smallest part: a CSV of ~11 MB goes up in three parts
TITLE = "t" * 1800  # ~1.9 KB a row: 6000 rows make a CSV of ~11.5 MB
ROWS = 6000
API_START = ["-m", "cli.main", "api", "--port", str(free_port())]  # stops at its start


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with s3_server() as running:
        yield running


@pytest.fixture
def bucket(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(s3_store, "PART_BYTES", PART_BYTES)
    with s3_environment(server):
        yield server.new_bucket()


def _expire(engine: sa.Engine, task_id: uuid.UUID) -> None:
    """The CSV's 24 hours ended a second ago, by the database's clock."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE background_tasks SET expires_at = now() - interval '1 s' WHERE id = :id"
            ),
            {"id": task_id},
        )


def _start(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A process of the cluster started as an operator would; it is expected to stop."""
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _chunk_rows(engine: sa.Engine, task_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM export_chunks WHERE task_id = :id")
        return int(conn.execute(query, {"id": task_id}).scalar_one())


def _big_tickets(engine: sa.Engine, world: World) -> None:
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, ROWS, title=TITLE)


def _export(engine: sa.Engine, world: World) -> uuid.UUID:
    with engine.begin() as conn:
        return service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})


def _object_key(bucket: str, prefix: str, task_id: uuid.UUID, execution_id: uuid.UUID) -> str:
    return rf"s3://{bucket}/{prefix}exports/{task_id}/{execution_id}-[0-9a-f]{{32}}\.csv"


def test_an_export_is_uploaded_while_it_reads_and_the_api_streams_or_redirects_it(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    server: S3Server,
    bucket: str,
    make_app: Callable[..., Celery],
) -> None:
    """A CSV of three parts: the upload is open while the COPY still reads (the first part
    went up at 5 MiB), the completion names the object, its size and SHA-256, and nothing
    is written to export_chunks. The API streams it whole, or
    answers a 307 to a presigned URL that serves the same bytes."""
    _big_tickets(engine, world)
    store = f"s3://{bucket}/cluster-a/"
    app = make_app(export_store=store, export_batch_size=1000)
    task_id = _export(engine, world)
    uploaded_during_read: list[int] = []

    def during_read(claim: lease.Claim, done: int, total: int) -> None:
        if done == 5000:  # the last batch but one: ~10 MB read, past the first part
            uploaded_during_read.append(len(server.open_uploads(bucket)))

    with hooks.installed("export.after_read", during_read), running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="the export")
    row = task_row(engine, task_id)
    expected = expected_csv(engine, world.team_id, world.staff_id, "TEAM", {}).encode()
    key = str(row["result_object"]).removeprefix(f"s3://{bucket}/")
    stored = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert re.fullmatch(
        _object_key(bucket, "cluster-a/", task_id, row["result_key"]), row["result_object"]
    )
    assert stored == expected and len(stored) > 2 * PART_BYTES
    assert (row["result_bytes"], row["result_sha256"]) == (
        len(expected),
        hashlib.sha256(expected).hexdigest(),
    )
    assert uploaded_during_read == [1]
    assert server.keys(bucket) == [key] and server.open_uploads(bucket) == []
    assert _chunk_rows(engine, task_id) == 0
    assert audit_events(engine, task_id) == ["CLAIM", "COMPLETE"]

    tokens = make_tokens(engine, world)
    streamed = settings.with_overrides(export_store=store)
    with api_client(streamed) as client:
        task = client.get(f"/api/tasks/{task_id}", headers=bearer(tokens["staff"]))
        download = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
        refused = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["customer"]))
    assert task.json()["has_csv"] is True
    assert download.status_code == 200 and download.content == expected
    assert download.headers["content-length"] == str(len(expected))
    assert refused.status_code == 404

    redirected = settings.with_overrides(export_store=store, export_download="redirect")
    with api_client(redirected) as client:
        answer = client.get(
            f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]), follow_redirects=False
        )
    assert answer.status_code == 307 and answer.headers["cache-control"] == "no-store"
    location = answer.headers["location"]
    assert location.startswith(f"{server.endpoint}/{bucket}/cluster-a/exports/{task_id}/")
    assert "X-Amz-Signature=" in location and "X-Amz-Expires=60" in location
    with urllib.request.urlopen(location, timeout=30) as fetched:  # the client's own GET
        assert fetched.read() == expected
        assert fetched.headers["Content-Disposition"] == (
            f'attachment; filename="export-{task_id}.csv"'
        )


def test_an_execution_that_loses_its_lease_after_uploading_leaves_no_object(
    engine: sa.Engine,
    world: World,
    bucket: str,
    server: S3Server,
    make_app: Callable[..., Celery],
) -> None:
    """The run is cancelled after the read passed its last check and before the result is
    written (a gate): the execution still finishes its upload, its fenced completion is
    refused, and it deletes its object. Nothing in the bucket, nothing served."""
    _big_tickets(engine, world)
    app = make_app(export_store=f"s3://{bucket}")
    task_id = _export(engine, world)

    def cancel_now(claim: lease.Claim) -> None:
        with engine.begin() as conn:
            service.cancel(conn, claim.lease.task_id, world.staff_id)

    with hooks.installed("export.before_result_write", cancel_now), running_cluster(app):
        wait_for(
            lambda: (
                audit_events(engine, task_id) == ["CLAIM", "CANCEL"]
                and task_row(engine, task_id)["execution_id"] is None
            ),
            what="the cancel",
        )
        wait_for(lambda: server.keys(bucket) == [], what="the late upload's removal")
    row = task_row(engine, task_id)
    assert (row["status"], row["result_object"], row["result_key"]) == ("CANCELLED", None, None)
    assert server.keys(bucket) == [] and server.open_uploads(bucket) == []


def test_a_refused_csv_aborts_its_multipart_upload(
    engine: sa.Engine,
    world: World,
    bucket: str,
    server: S3Server,
    make_app: Callable[..., Celery],
) -> None:
    """A CSV that passes EXPORT_MAX_BYTES after a part went up: the export fails with the
    usual reason and its open multipart upload is aborted (no part stays billed)."""
    _big_tickets(engine, world)
    app = make_app(export_store=f"s3://{bucket}", export_max_bytes=7 << 20)
    task_id = _export(engine, world)
    with running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "FAILED", what="the refusal")
    row = task_row(engine, task_id)
    assert row["last_error"] == (
        f"The export's CSV would be larger than {7 << 20} bytes; narrow the filters."
    )
    assert (row["result_object"], server.keys(bucket), server.open_uploads(bucket)) == (
        None,
        [],
        [],
    )


def _completed_in_store(
    engine: sa.Engine, world: World, target: export_store.StoreTarget, csv: bytes
) -> uuid.UUID:
    """An export completed by an execution that uploaded ``csv`` (the worker's path)."""
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with engine.connect() as conn:
        held = lease.claim(conn, task_id, 0, "test-host/store")
        assert held is not None
        upload = s3_store.object_store().writer(target, task_id, held.lease.execution_id)
        sink = artifacts.ObjectSink(upload, held.lease.execution_id)
        sink.write(lambda: conn, csv)
        lease.complete_export(conn, held.lease, sink.finish(conn), "1 row")
        conn.commit()
    return task_id


def test_the_purge_removes_expired_objects_then_orphans_and_open_uploads_past_the_grace(
    engine: sa.Engine,
    world: World,
    bucket: str,
    server: S3Server,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expired CSVs' objects go with the purge, and their rows forget them. An object no
    row names (an execution that crashed between its upload and its completion) and a
    multipart upload a crash left open are kept while younger than the grace (they may
    belong to a live execution), and removed once older, by the database's clock; a named
    object is never touched. Another prefix's objects are not the cluster's."""
    app = make_app(export_store=f"s3://{bucket}/a")
    target = export_store.StoreTarget(bucket, "a/")
    kept = _completed_in_store(engine, world, target, b"id\r\n1\r\n")
    expired = _completed_in_store(engine, world, target, b"id\r\n2\r\n")
    _expire(engine, expired)
    client = server.client()
    orphan = export_store.object_key(target, kept, uuid.uuid4())  # a crashed execution's
    client.put_object(Bucket=bucket, Key=orphan, Body=b"id\r\n")
    stranger = f"b/exports/{kept}/{uuid.uuid4()}-{'0' * 32}.csv"  # another cluster's prefix
    client.put_object(Bucket=bucket, Key=stranger, Body=b"id\r\n")
    expired_key = str(task_row(engine, expired)["result_object"]).removeprefix(f"s3://{bucket}/")
    named_key = str(task_row(engine, kept)["result_object"]).removeprefix(f"s3://{bucket}/")
    cluster = Cluster(app, get_settings())
    try:
        young = objects.purge_objects(cluster)
        after_young = server.keys(bucket)
        # Opened only now: this S3 server reports every upload as opened in 2010, so a
        # young open upload cannot be shown here (the rule is the objects' one).
        open_key = export_store.object_key(target, kept, uuid.uuid4())
        client.create_multipart_upload(Bucket=bucket, Key=open_key)
        monkeypatch.setattr(objects, "GRACE_S", -get_settings().export_read_budget_s)
        cluster.object_sweep_after = ""
        old = objects.purge_objects(cluster)
    finally:
        cluster.close()
    assert (young.expired, young.orphans, young.error) == (1, 0, None)
    assert after_young == sorted([named_key, orphan, stranger])
    assert (old.expired, old.orphans, old.error) == (0, 2, None)
    assert server.keys(bucket) == sorted([named_key, stranger])
    assert server.open_uploads(bucket) == []
    assert expired_key not in after_young
    gone, named = task_row(engine, expired), task_row(engine, kept)
    assert (gone["result_object"], gone["result_key"], gone["status"]) == (None, None, "COMPLETED")
    assert named["result_object"] == f"s3://{bucket}/{named_key}"


def test_a_store_that_cannot_be_reached_answers_503_and_the_purge_goes_on(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    bucket: str,
    server: S3Server,
    make_app: Callable[..., Celery],
) -> None:
    """The store down (its endpoint refuses connections): a download answers the same 503
    as a database outage, with Retry-After; the dispatcher's purge logs the failure and the
    rest of its pass runs. Nothing is forgotten: the row still names its object."""
    app = make_app(export_store=f"s3://{bucket}")
    target = export_store.StoreTarget(bucket)
    task_id = _completed_in_store(engine, world, target, b"id\r\n1\r\n")
    tokens = make_tokens(engine, world)
    with s3_environment(S3Server(f"http://127.0.0.1:{free_port()}")):  # nothing listens
        with api_client(settings.with_overrides(export_store=f"s3://{bucket}")) as client:
            answer = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
        _expire(engine, task_id)
        cluster = Cluster(app, get_settings())
        try:
            done = objects.purge_objects(cluster)
        finally:
            cluster.close()
    assert (answer.status_code, answer.headers.get("retry-after")) == (503, "5")
    assert answer.json() == {"detail": "the service is temporarily unavailable; try again shortly"}
    assert done.expired == 0 and done.error is not None and "EndpointConnectionError" in done.error
    assert task_row(engine, task_id)["result_object"] is not None


@pytest.mark.parametrize("store", ["postgres", "s3"])
def test_both_stores_complete_and_serve_the_same_export(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    bucket: str,
    make_app: Callable[..., Celery],
    store: str,
) -> None:
    """The same export, through the same API, from either store: the CSV the reference
    says, its size and SHA-256 in the row, and it is where EXPORT_STORE says (chunks, or
    one object and no chunk)."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 120, title='Café; "=1+1"')
    where = "postgres" if store == "postgres" else f"s3://{bucket}/both"
    app = make_app(export_store=where, export_batch_size=50)
    task_id = _export(engine, world)
    with running_cluster(app):
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="the export")
    tokens = make_tokens(engine, world)
    with api_client(settings.with_overrides(export_store=where)) as client:
        download = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    expected = expected_csv(engine, world.team_id, world.staff_id, "TEAM", {}).encode()
    row = task_row(engine, task_id)
    assert download.status_code == 200 and download.content == expected
    assert (row["result_bytes"], row["result_sha256"]) == (
        len(expected),
        hashlib.sha256(expected).hexdigest(),
    )
    if store == "postgres":
        assert row["result_object"] is None and _chunk_rows(engine, task_id) == 1
    else:
        assert str(row["result_object"]).startswith(f"s3://{bucket}/both/exports/{task_id}/")
        assert _chunk_rows(engine, task_id) == 0


def test_a_store_lost_mid_upload_fails_the_attempt_and_the_retry_completes(
    engine: sa.Engine,
    world: World,
    server: S3Server,
    bucket: str,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's connections break while the first attempt uploads (a gate after the
    first part): the attempt fails and is retried; its half-done upload is never named,
    and (its abort failing too, the store being gone) the sweep aborts it later. The retry
    uploads the whole CSV, which is the one served."""
    _big_tickets(engine, world)
    port = int(server.endpoint.rsplit(":", 1)[1])
    claims: list[uuid.UUID] = []
    with tcp_proxy("127.0.0.1", port) as proxy:
        through = S3Server(f"http://127.0.0.1:{proxy.port}")
        with s3_environment(through):
            app = make_app(
                export_store=f"s3://{bucket}", export_batch_size=1000, retry_base_delay_s=0.2
            )
            task_id = _export(engine, world)

            def claimed(claim: lease.Claim) -> None:
                claims.append(claim.lease.execution_id)
                proxy.accept_new()  # the retry finds the store again

            def after_read(claim: lease.Claim, done: int, total: int) -> None:
                if len(claims) == 1 and done == 5000:  # a part went up: the store goes away
                    proxy.cut()

            with (
                hooks.installed("task.claimed", claimed),
                hooks.installed("export.after_read", after_read),
                running_cluster(app),
            ):
                wait_for(
                    lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="the retry"
                )
        row = task_row(engine, task_id)
        first, second = claims
        assert audit_events(engine, task_id) == ["CLAIM", "WAIT", "CLAIM", "COMPLETE"]
        assert row["result_key"] == second and f"/{second}-" in row["result_object"]
        left_open = server.open_uploads(bucket)
        assert [k for k in left_open if f"/{first}-" in k] == left_open and len(left_open) == 1
        assert server.keys(bucket) == [str(row["result_object"]).removeprefix(f"s3://{bucket}/")]
        monkeypatch.setattr(objects, "GRACE_S", -get_settings().export_read_budget_s)
        cluster = Cluster(app, get_settings())
        try:
            swept = objects.purge_objects(cluster)
        finally:
            cluster.close()
    assert (swept.orphans, swept.error, server.open_uploads(bucket)) == (1, None, [])
    expected = expected_csv(engine, world.team_id, world.staff_id, "TEAM", {}).encode()
    key = str(row["result_object"]).removeprefix(f"s3://{bucket}/")
    assert server.client().get_object(Bucket=bucket, Key=key)["Body"].read() == expected


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("celery worker", ["-m", "celery", "-A", "tasks", "worker", "--pool", "solo"]),
        ("celery beat", ["-m", "celery", "-A", "tasks", "beat"]),
        ("teamdesk-tasks api", API_START),
    ],
)
def test_a_missing_bucket_stops_every_process_at_its_start(
    settings: Settings, server: S3Server, command: str, argv: list[str]
) -> None:
    """One line naming the setting, exit code 2, before the process serves anything."""
    missing = f"td-missing-{uuid.uuid4().hex[:8]}"
    env = settings_env(settings, EXPORT_STORE=f"s3://{missing}/x", **server.env)
    done = _start(argv, env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"{command}: configuration error: EXPORT_STORE=s3://{missing}/x/: bucket {missing} "
        "does not exist"
    )


def test_bad_credentials_and_an_unreachable_store_are_said_in_one_line(
    settings: Settings, bucket: str
) -> None:
    """A store that checks credentials (this server refuses unknown keys) and an endpoint
    where nothing listens: the API's start says which, and exits 2."""
    with s3_server(require_auth=True) as strict:
        strict_bucket = "td-strict"
        env = settings_env(settings, EXPORT_STORE=f"s3://{strict_bucket}", **strict.env)
        refused = _start(API_START, env)
    nowhere = S3Server(f"http://127.0.0.1:{free_port()}")
    env = settings_env(settings, EXPORT_STORE=f"s3://{bucket}", **nowhere.env)
    unreachable = _start(API_START, env)
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1]) == (
        2,
        f"teamdesk-tasks api: configuration error: EXPORT_STORE=s3://{strict_bucket}/: the "
        f"object store at {strict.endpoint} does not accept these credentials "
        "(InvalidAccessKeyId): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the role",
    )
    assert (unreachable.returncode, unreachable.stderr.strip().splitlines()[-1]) == (
        2,
        f"teamdesk-tasks api: configuration error: EXPORT_STORE=s3://{bucket}/: the object "
        f"store at {nowhere.endpoint} cannot be reached",
    )


def test_a_silent_store_holds_neither_a_scan_nor_a_row_lock(
    engine: sa.Engine,
    world: World,
    bucket: str,
    make_app: Callable[..., Celery],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that accepts connections and never answers (found by an operator's review:
    each purge held the dispatcher, and a row lock, for two minutes). The scan starts the
    object purge on its own thread and returns while that pass waits on the store; the
    expired row it read is not locked meanwhile. When the store's connection breaks, the
    pass fails, logs it, and the row still names its object for the next pass."""
    app = make_app(export_store=f"s3://{bucket}")
    task_id = _completed_in_store(engine, world, export_store.StoreTarget(bucket), b"id\r\n")
    _expire(engine, task_id)
    monkeypatch.setattr(s3_store, "READ_TIMEOUT_S", 60)  # the pass waits: the gate ends it
    monkeypatch.setattr(s3_store, "MAX_ATTEMPTS", 1)
    silent = socket.create_server(("127.0.0.1", 0))
    silent.settimeout(30)
    try:
        with s3_environment(S3Server(f"http://127.0.0.1:{silent.getsockname()[1]}")):
            cluster = Cluster(app, get_settings())
            try:
                scan_module.scan(cluster, Window(cluster), purge=True)
                waiting, _ = silent.accept()  # the gate: the pass is in its store call
                try:
                    held = cluster.object_purges.running()
                    with engine.begin() as conn:
                        locked = conn.execute(
                            sa.text(
                                "SELECT 1 FROM background_tasks WHERE id = :id FOR UPDATE NOWAIT"
                            ),
                            {"id": task_id},
                        ).scalar_one()
                finally:
                    silent.close()  # the store goes away: the pass fails at once
                    waiting.close()
            finally:
                cluster.close()  # waits for the pass
    finally:
        silent.close()
    assert (held, locked) == (True, 1)
    assert task_row(engine, task_id)["result_object"] is not None
    failures = [r for r in caplog.records if getattr(r, "event", "") == "dispatcher.store_failed"]
    assert failures, [r.getMessage() for r in caplog.records]
