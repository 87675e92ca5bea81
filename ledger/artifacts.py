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

Durability: each chunk commits on its own, synchronously, before the completion is sent,
so a completed CSV never misses a chunk.
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

CHUNK_BYTES = 1 << 20  # 1 MiB: what a worker buffers and an API request holds at once
STATEMENT_TIMEOUT_MS = 60_000

COPY_CHUNK = "COPY export_chunks (task_id, execution_id, seq, data) FROM STDIN WITH (FORMAT binary)"
LOCAL_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"
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
    """A CSV stored as chunks: whose, how large, in how many pieces, its SHA-256."""

    key: uuid.UUID
    size: int
    chunks: int
    sha256: str


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
        cursor.execute(("BEGIN; " if own else "") + LOCAL_TIMEOUT, (f"{STATEMENT_TIMEOUT_MS}ms",))
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
