"""A CSV download never holds the file (api/downloads.py; issue "Security, round four",
finding 3; issue "Export artifacts off the primary"): a real ``teamdesk-tasks api``
process serves eight parallel downloads of one 32 MiB export, kept in PostgreSQL or in an
object store (four tokens, two downloads each: the per-token bound), every client
reading slowly, and the process's peak resident memory (``VmHWM``, the kernel's
high-water mark) stays under 256 MiB. Before, the API held each CSV twice (text and
bytes): eight downloads of a 33.5 MB export took it from 80 to 922 MiB.

Every download is the whole CSV, byte for byte (its SHA-256), with ``Content-Length``;
a ninth download while eight stream answers 429 (the process's bound), as does a third of
one token's.
"""

from __future__ import annotations

import hashlib
import http.client
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from api.downloads import MAX_DOWNLOADS, MAX_DOWNLOADS_PER_TOKEN
from harness.factories import World, add_member, add_user
from harness.processes import Proc, cluster, free_port, settings_env
from harness.s3_server import s3_server
from harness.waiting import wait_for
from ledger import artifacts, lease, service
from ledger.tokens import create_token
from teamdesk import export_store, s3_store
from teamdesk.config import Settings
from tests.support.s3 import s3_environment

pytestmark = pytest.mark.slow

CSV_BYTES = 32 << 20
PEAK_LIMIT_KIB = 256 << 10
READ_PIECE = 64 << 10


def big_csv() -> bytes:
    line = b'"00000000-0000-0000-0000-000000000000","a title of some length",OPEN,HIGH\n'
    body = line * (CSV_BYTES // len(line))
    return b"id,title,status,priority\n" + body


def peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/api/health", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.fixture(params=["postgres", "s3"])
def store(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Where the CSV is kept, as the API's environment says: PostgreSQL's chunks, or an
    object of moto's S3 server (harness/s3_server.py)."""
    if request.param == "postgres":
        yield {}
        return
    with s3_server() as server, s3_environment(server):
        yield {"EXPORT_STORE": f"s3://{server.new_bucket()}/memory", **server.env}


def _complete(engine: sa.Engine, task_id: uuid.UUID, data: bytes, store: dict[str, str]) -> None:
    """The export completed with ``data``, stored where ``store`` says (the worker's path)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        held = lease.claim(conn, task_id, 0, "test-host/download")
        assert held is not None
        target = export_store.parse_store(store.get("EXPORT_STORE", ""))
        if target is None:
            lease.complete_export(conn, held.lease, data, "big")
            return
        execution = held.lease.execution_id
        sink = artifacts.ObjectSink(
            s3_store.object_store().writer(target, task_id, execution), execution
        )
        sink.write(lambda: conn, data)
        lease.complete_export(conn, held.lease, sink.finish(conn), "big")


def test_parallel_downloads_of_a_32_mib_csv_keep_the_api_small(
    settings: Settings, engine: sa.Engine, world: World, tmp_path: Path, store: dict[str, str]
) -> None:
    data = big_csv()
    with engine.begin() as conn:
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    _complete(engine, task_id, data, store)
    tokens: list[str] = []
    with engine.begin() as conn:
        for i in range(MAX_DOWNLOADS // MAX_DOWNLOADS_PER_TOKEN):
            user = world.staff_id if i == 0 else add_user(conn, f"Staff {i}")
            if i:
                add_member(conn, world.team_id, user, "STAFF")
            tokens.append(create_token(conn, user, f"download {i}"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "cli.main", "api", "--port", str(port)]
    path = f"/api/tasks/{task_id}/csv"

    def start(token: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse()

    with cluster(tmp_path) as procs:
        api = Proc("api", argv, settings_env(settings, **store), tmp_path).start()
        procs.append(api)
        wait_for(lambda: healthy(base), timeout=60, what="the API")
        before = peak_kib(api.pid)
        streams = [start(token) for token in tokens for _ in range(MAX_DOWNLOADS_PER_TOKEN)]
        statuses = [s.status for s in streams]
        # Eight stream now: a ninth (another token) and a third of one token are refused.
        with engine.begin() as conn:
            ninth_user = add_user(conn, "Staff ninth")
            add_member(conn, world.team_id, ninth_user, "STAFF")
            ninth_token = create_token(conn, ninth_user, "ninth")
        ninth = start(ninth_token)
        third = start(tokens[0])
        refused = [(r.status, r.getheader("Retry-After")) for r in (ninth, third)]
        digests: list[str] = []
        lengths: list[str | None] = []

        def drain(stream: http.client.HTTPResponse) -> None:
            lengths.append(stream.getheader("Content-Length"))
            digest = hashlib.sha256()
            while piece := stream.read(READ_PIECE):
                digest.update(piece)
            digests.append(digest.hexdigest())

        readers = [threading.Thread(target=drain, args=(s,)) for s in streams]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(120)
        peak = peak_kib(api.pid)
        after = start(tokens[0])  # the slots came back
        after_status = after.status
        after.read()
    where = store.get("EXPORT_STORE", "postgres")
    print(f"API peak RSS ({where}): {before // 1024} MiB before, {peak // 1024} MiB after 8")
    assert statuses == [200] * MAX_DOWNLOADS
    assert refused == [(429, "1"), (429, "1")]
    assert digests == [hashlib.sha256(data).hexdigest()] * MAX_DOWNLOADS
    assert lengths == [str(len(data))] * MAX_DOWNLOADS
    assert peak < PEAK_LIMIT_KIB, f"peak RSS {peak // 1024} MiB"
    assert after_status == 200
