"""An export's CSV in chunks keyed by the execution that wrote them, or in an object store;
the statements that read and purge them (docs/design.md, "Exports").
"""

from __future__ import annotations

import hashlib
import io
import struct
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import psycopg2
from sqlalchemy.engine import Connection

from ledger import prepared
from teamdesk.export_store import ObjectLocation, ObjectWriter, OpenUpload, StoredObject

CHUNK_BYTES = 1 << 20  # 1 MiB: what a worker buffers and an API request holds at once
STATEMENT_TIMEOUT_MS = 60_000

COPY_CHUNK = "COPY export_chunks (task_id, execution_id, seq, data) FROM STDIN WITH (FORMAT binary)"
LOCAL_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"
# Its commit does not wait for the disk: the completion's does, for every chunk before it.
OWN_CHUNK_TRANSACTION = (
    "BEGIN; SELECT set_config('statement_timeout', %s, true),"
    " set_config('synchronous_commit', 'off', true)"
)
# PostgreSQL's binary COPY framing: the signature, flags and header extension, and the
# end-of-data marker (a field count of -1).
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)
# Given only to a live token whose user may see the task now (migration 0014).
CHUNK_FUNCTION = "teamdesk_export_chunk_v1"
CHUNK_SIGNATURE = "text, uuid, uuid, integer"
READ_CHUNK = f"""
    SELECT {CHUNK_FUNCTION}(%(token_hash)s, CAST(%(task_id)s AS uuid),
                            CAST(%(key)s AS uuid), CAST(%(seq)s AS integer))
"""
# Chunks of an execution that is neither the completed CSV's (result_key) nor a RUNNING
# row's. The minute's grace covers a claim a reader has not seen yet. A late execution
# still writing after its first chunk went leaves chunks no walk meets: its task takes them.
PURGE_ORPHANS = """
    WITH orphans AS (
        SELECT c.task_id, c.execution_id FROM export_chunks c
         WHERE c.seq = 0 AND c.created_at < now() - interval '1 minute'
           AND NOT EXISTS (
               SELECT FROM background_tasks t
                WHERE t.id = c.task_id
                  AND (t.result_key = c.execution_id
                       OR (t.status = 'RUNNING' AND t.execution_id = c.execution_id)))
         ORDER BY c.created_at
         LIMIT %(batch)s
    )
    DELETE FROM export_chunks c USING orphans o
     WHERE c.task_id = o.task_id AND c.execution_id = o.execution_id
"""


@dataclass(frozen=True)
class Artifact:
    """A stored CSV: whose (the execution that wrote it), how large, in how many pieces,
    its SHA-256, and, in an object store, its object (``s3://BUCKET/KEY``; None: chunks)."""

    key: uuid.UUID
    size: int
    chunks: int
    sha256: str
    location: str | None = None


class ChunkWriter:
    """Writes one execution's CSV as chunks: :meth:`write` appends and sends each full
    chunk through the connection ``conn_of`` gives (asked for only when a chunk is full);
    :meth:`finish` sends the rest (a CSV has at least its header, so at least one chunk)
    and says what was stored."""

    def __init__(
        self, task_id: uuid.UUID, execution_id: uuid.UUID, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.task_id, self.execution_id, self.chunk_bytes = task_id, execution_id, chunk_bytes
        self.buffer = bytearray()
        self.size = 0
        self.chunks = 0
        self._sha256 = hashlib.sha256()

    def write(self, conn_of: Callable[[], Connection], data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= self.chunk_bytes:
            piece = bytes(self.buffer[: self.chunk_bytes])
            del self.buffer[: self.chunk_bytes]
            self._send(conn_of(), piece)

    def finish(self, conn: Connection) -> Artifact:
        if self.buffer or not self.chunks:
            piece, self.buffer = bytes(self.buffer), bytearray()
            self._send(conn, piece)
        return Artifact(self.execution_id, self.size, self.chunks, self._sha256.hexdigest())

    def abort(self) -> None:
        """Nothing now: chunks no completion names are orphans, which the dispatcher's
        retention step removes (:data:`PURGE_ORPHANS`)."""

    def _send(self, conn: Connection, piece: bytes) -> None:
        """One chunk, as one row of a binary ``COPY``, in a transaction of its own on an
        autocommit connection, else in the caller's (which keeps its durability)."""
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        own = bool(dbapi.autocommit)
        if not own and not conn.in_transaction():
            conn.begin()
        cursor = dbapi.cursor()
        row = _copy_row(self.task_id, self.execution_id, self.chunks, piece)
        opening = OWN_CHUNK_TRANSACTION if own else LOCAL_TIMEOUT
        cursor.execute(opening, (f"{STATEMENT_TIMEOUT_MS}ms",))
        try:
            cursor.copy_expert(COPY_CHUNK, io.BytesIO(row), size=len(row))
        except BaseException:
            if own:
                with suppress(psycopg2.Error):
                    cursor.execute("ROLLBACK")
            raise
        if own:
            cursor.execute("COMMIT")
        self._sha256.update(piece)
        self.size += len(piece)
        self.chunks += 1


class ObjectSink:
    """An execution's CSV uploaded to the object store (teamdesk/export_store.py) as its
    read streams: the calls of :class:`ChunkWriter`, so the export writes either the same
    way. :meth:`abort` removes the upload (a refused CSV, a failed read, a lost lease)."""

    def __init__(self, writer: ObjectWriter, execution_id: uuid.UUID) -> None:
        self.writer, self.execution_id = writer, execution_id

    def write(self, conn_of: Callable[[], Connection], data: bytes) -> None:
        self.writer.write(conn_of, data)

    def finish(self, conn: Connection) -> Artifact:
        size, parts, sha256 = self.writer.finish_upload()
        return Artifact(self.execution_id, size, parts, sha256, self.writer.location.url)

    def abort(self) -> None:
        self.writer.abort()


def _copy_row(task_id: uuid.UUID, execution_id: uuid.UUID, seq: int, piece: bytes) -> bytes:
    """One row of ``export_chunks`` in binary COPY form: four fields, each its length and
    its bytes (a uuid's 16, an int4's 4 in network order, the chunk's own)."""
    return b"".join(
        (
            _COPY_HEADER,
            struct.pack("!hi", 4, 16),
            task_id.bytes,
            struct.pack("!i", 16),
            execution_id.bytes,
            struct.pack("!ii", 4, seq),
            struct.pack("!i", len(piece)),
            piece,
            _COPY_TRAILER,
        )
    )


def store(conn: Connection, task_id: uuid.UUID, execution_id: uuid.UUID, csv: bytes) -> Artifact:
    """The whole of a small CSV, written at once (the writer's path, in one call)."""
    writer = ChunkWriter(task_id, execution_id)
    writer.write(lambda: conn, csv)
    return writer.finish(conn)


def read_chunk(
    conn: Connection, token_hash: str, task_id: uuid.UUID, key: uuid.UUID | None, seq: int
) -> bytes | None:
    """Chunk ``seq`` of the task's CSV stored under ``key`` (None: the one an earlier
    release stored in the row), for the token with ``token_hash``; None past the end, and
    when the CSV is gone (expired or purged since the download started) or the token's
    user may not see the task (now)."""
    params = {
        "token_hash": token_hash,
        "task_id": str(task_id),
        "key": None if key is None else str(key),
        "seq": seq,
    }
    row = prepared.execute(conn, READ_CHUNK, params, STATEMENT_TIMEOUT_MS).fetchone()
    return None if row is None or row[0] is None else bytes(row[0])


def purge_orphans(conn: Connection, batch: int) -> int:
    """Remove the chunks of up to ``batch`` executions no row names; how many chunks."""
    params = {"batch": batch}
    return int(prepared.execute(conn, PURGE_ORPHANS, params, STATEMENT_TIMEOUT_MS).rowcount)


# As CHUNK_FUNCTION's rule (migration 0015); NULL when the CSV is not in an object store.
OBJECT_FUNCTION = "teamdesk_export_object_v1"
OBJECT_SIGNATURE = "text, uuid"
OBJECT_OF = f"SELECT {OBJECT_FUNCTION}(%(token_hash)s, CAST(%(task_id)s AS uuid))"

# Objects of CSVs past their 24 h (ix_background_tasks_objects_expiring); read, not locked:
# the caller deletes them from the store with no transaction open...
EXPIRED_OBJECTS = """
    SELECT id, result_object FROM background_tasks
     WHERE result_object IS NOT NULL AND expires_at < now()
     ORDER BY expires_at
     LIMIT %(batch)s
"""
# ... then the rows forget them: those still naming the object that was deleted.
FORGET_OBJECTS = """
    UPDATE background_tasks t
       SET result_object = NULL, result_key = NULL, result_sha256 = NULL, updated_at = now()
      FROM unnest(CAST(CAST(%(ids)s AS text[]) AS uuid[]), CAST(%(urls)s AS text[]))
           AS gone(id, url)
     WHERE t.id = gone.id AND t.result_object = gone.url
"""
# Past the grace (an object appears just before its completion names it), looked up by
# the task's primary key (the object's key names the task).
UNNAMED_OBJECTS = """
    SELECT o.url FROM unnest(CAST(%(urls)s AS text[]),
                             CAST(CAST(%(tasks)s AS text[]) AS uuid[]),
                             CAST(%(at)s AS timestamptz[])) AS o(url, task_id, at)
     WHERE o.at < now() - make_interval(secs => %(grace_s)s)
       AND NOT EXISTS (SELECT FROM background_tasks t
                        WHERE t.id = o.task_id AND t.result_object = o.url)
"""
# Of multipart uploads found open, those older than the grace by the database's clock.
STALE_UPLOADS = """
    SELECT o.n FROM unnest(CAST(%(at)s AS timestamptz[])) WITH ORDINALITY AS o(at, n)
     WHERE o.at < now() - make_interval(secs => %(grace_s)s)
"""


def object_of(conn: Connection, token_hash: str, task_id: uuid.UUID) -> ObjectLocation | None:
    """The object of the task's kept CSV, for the token with ``token_hash``; None when its
    CSV is not in an object store, is gone, or the token's user may not see the task."""
    params = {"token_hash": token_hash, "task_id": str(task_id)}
    row = prepared.execute(conn, OBJECT_OF, params, STATEMENT_TIMEOUT_MS).fetchone()
    return None if row is None or row[0] is None else ObjectLocation.parse(row[0])


def expired_objects(conn: Connection, batch: int) -> dict[uuid.UUID, ObjectLocation]:
    """Up to ``batch`` expired CSVs' objects, by task (read only: the store deletes them,
    then :func:`forget_objects`)."""
    rows = prepared.execute(conn, EXPIRED_OBJECTS, {"batch": batch}, STATEMENT_TIMEOUT_MS)
    return {uuid.UUID(str(r[0])): ObjectLocation.parse(r[1]) for r in rows.fetchall()}


def forget_objects(conn: Connection, deleted: dict[uuid.UUID, ObjectLocation]) -> int:
    """The rows forget the objects the store deleted (each only if it still names that
    object); how many did."""
    params = {
        "ids": [str(t) for t in deleted],
        "urls": [loc.url for loc in deleted.values()],
    }
    return int(prepared.execute(conn, FORGET_OBJECTS, params, STATEMENT_TIMEOUT_MS).rowcount)


def unnamed_objects(
    conn: Connection, found: list[StoredObject], grace_s: float
) -> list[ObjectLocation]:
    """Of ``found``, the objects no row names (orphans: executions that never completed)."""
    if not found:
        return []
    params = {
        "urls": [o.location.url for o in found],
        "tasks": [str(o.task_id) for o in found],
        "at": [o.modified for o in found],
        "grace_s": grace_s,
    }
    rows = prepared.execute(conn, UNNAMED_OBJECTS, params, STATEMENT_TIMEOUT_MS).fetchall()
    return [ObjectLocation.parse(r[0]) for r in rows]


def stale_uploads(conn: Connection, uploads: list[OpenUpload], grace_s: float) -> list[OpenUpload]:
    """Of ``uploads``, those opened longer ago than the grace (by the database's clock)."""
    if not uploads:
        return []
    params = {"at": [u.initiated for u in uploads], "grace_s": grace_s}
    rows = prepared.execute(conn, STALE_UPLOADS, params, STATEMENT_TIMEOUT_MS).fetchall()
    return [uploads[int(r[0]) - 1] for r in rows]
