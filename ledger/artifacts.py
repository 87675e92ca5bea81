"""An export's CSV beside its ledger row, in bounded chunks (docs/design.md, "Exports").

The worker writes the CSV while its read streams, ``CHUNK_BYTES`` at a time, into
``export_chunks`` under the key of its own execution (task id, execution id): a replaced
or late execution writes only under its own key, never into another's CSV. Nothing is
served until the fenced completion (ledger/lease.py ``complete_export``) names the key,
with the CSV's size and SHA-256, after every chunk was written. The API then streams
those chunks one by one (:func:`read_chunk`, through an owner's function that checks the
caller's token and the may-see rule for each chunk): neither process ever holds a whole
CSV.

Chunks of executions that never completed (a lost lease, a crash mid-read, a refused
CSV) are orphans: :data:`PURGE_ORPHANS` removes them (the dispatcher's retention step),
and the expiry step removes a completed CSV's chunks after its 24 hours
(ledger/dispatch.py). Deleting a task deletes its chunks (``ON DELETE CASCADE``).

Durability: each chunk commits on its own before the completion is sent, without
waiting for its WAL to reach the disk (``synchronous_commit = off`` for that transaction
only). The completion's commit is synchronous, and the write-ahead log is flushed (and,
with synchronous standbys, replicated) in order, up to the completion's record: so once
a completion is durable every chunk it names is too. A crash before it loses at most the
chunks of an execution that never completed, which nothing names. One flush per export,
not one per chunk.
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
# A chunk's own transaction: bounded, and its commit does not wait for the disk (the
# completion's does, for every chunk before it: the module's docstring).
OWN_CHUNK_TRANSACTION = (
    "BEGIN; SELECT set_config('statement_timeout', %s, true),"
    " set_config('synchronous_commit', 'off', true)"
)
# PostgreSQL's binary COPY framing: the signature, flags and header extension, and the
# end-of-data marker (a field count of -1).
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)
# A chunk, through the owner's function (migration 0014): given only to a live token whose
# user may see the task now; the API's role may not read export_chunks.
CHUNK_FUNCTION = "teamdesk_export_chunk_v1"
CHUNK_SIGNATURE = "text, uuid, uuid, integer"
READ_CHUNK = f"""
    SELECT {CHUNK_FUNCTION}(%(token_hash)s, CAST(%(task_id)s AS uuid),
                            CAST(%(key)s AS uuid), CAST(%(seq)s AS integer))
"""
# The CSVs no row names: an execution's chunks when neither a completed CSV (result_key)
# nor the execution holding a RUNNING row (still writing) is theirs. Walked by each
# execution's first chunk (ix_export_chunks_created_at), oldest first, at most ``batch``
# executions per call; a minute's grace covers a chunk committed by an execution whose
# claim a reader has not seen yet. A late execution that goes on writing after its first
# chunk went leaves chunks no walk meets: they go with their task (retention).
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
        """One chunk, as one row of a binary ``COPY``: the bytes as they are (a bytea
        literal would send each byte as two hex digits and have the server parse them)."""
        # A COPY is a statement of its own: its bound is set for its transaction (never
        # for the session: behind PgBouncer in transaction pooling that would stay on a
        # server session other clients get). An autocommit connection gets a transaction
        # for the chunk; one outside autocommit begins its own as SQLAlchemy's would.
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        own = bool(dbapi.autocommit)
        if not own and not conn.in_transaction():
            conn.begin()
        cursor = dbapi.cursor()
        row = _copy_row(self.task_id, self.execution_id, self.chunks, piece)
        # In the caller's transaction only the bound is set: its commit (a completion
        # with it, perhaps) keeps the caller's durability.
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


# The object of a kept CSV, through the owner's function (migration 0015): given only to a
# live token whose user may see the task now; NULL when the CSV is not in an object store.
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
# Of objects found in the store, those no row names: older than the grace by the
# database's clock (an execution's object appears when its upload ends, just before its
# completion names it), and not the CSV their task's row names. Looked up by the task's
# primary key (the key names it).
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
