"""Handing a large text to PostgreSQL without a second copy of it in memory.

A statement carrying a 20 MB literal exists three times at its peak: the text, the
statement built around it, and the driver's send buffer (libpq grows it by doubling).
``COPY ... FROM STDIN`` reads the text from the buffer in 64 KiB pieces instead, so the
process holds the buffer and nothing more. The text goes into a temporary table of the
session, created inside the caller's transaction and dropped when it ends
(``ON COMMIT DROP``), as one binary COPY row: the bytes as they are, no escaping.
"""

from __future__ import annotations

import struct

import psycopg2
from sqlalchemy.engine import Connection

from ledger import prepared

STAGE_TABLE = "pg_temp.teamdesk_staged_text"
# Smaller texts go as a literal: staging costs the server a second write of the text
# (10k rows, 2.6 MB: about 10 ms more than the literal), while a few MB held three times
# for a moment cost the worker little.
STAGE_MIN_BYTES = 8 << 20
CHUNK_BYTES = 64 << 10

# Opens the transaction the caller ends (COMMIT or ROLLBACK) on an autocommit connection.
STAGE = f"""
    BEGIN;
    SELECT set_config('statement_timeout', '{{bound_ms}}ms', true);
    CREATE TEMP TABLE teamdesk_staged_text (value text NOT NULL) ON COMMIT DROP;
    COPY {STAGE_TABLE} (value) FROM STDIN WITH (FORMAT binary)
"""
_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_TRAILER = struct.pack("!h", -1)


class BinaryCopyReader:
    """The file ``copy_expert`` reads: the binary COPY framing around one text field,
    served from the caller's buffer in pieces (never copied whole)."""

    def __init__(self, data: bytearray) -> None:
        self.parts = [
            memoryview(_HEADER + struct.pack("!hi", 1, len(data))),
            memoryview(data),
            memoryview(_TRAILER),
        ]
        self.part, self.offset = 0, 0

    def read(self, size: int = CHUNK_BYTES) -> bytes:
        while self.part < len(self.parts):
            view = self.parts[self.part]
            if self.offset < len(view):
                piece = bytes(view[self.offset : self.offset + max(1, size)])
                self.offset += len(piece)
                return piece
            view.release()
            self.part, self.offset = self.part + 1, 0
        return b""


def stage(conn: Connection, data: bytearray, bound_ms: int) -> bool:
    """Open a transaction on ``conn`` (autocommit) holding ``data`` in the temporary
    table, its statements bounded by ``bound_ms``; the caller reads it in its statement,
    then commits or rolls back. False (and no transaction open) when the role may not
    create temporary tables."""
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    cursor = dbapi.cursor()
    try:
        statement = STAGE.format(bound_ms=int(bound_ms))
        cursor.copy_expert(statement, BinaryCopyReader(data), size=CHUNK_BYTES)
    except psycopg2.errors.InsufficientPrivilege:
        cursor.execute("ROLLBACK")
        return False
    except (psycopg2.OperationalError, psycopg2.InterfaceError):
        conn.invalidate()  # the server connection is gone: the pool must not reuse it
        raise
    except psycopg2.Error:
        cursor.execute("ROLLBACK")
        raise
    return True


def end(conn: Connection, commit: bool) -> None:
    """End the transaction :func:`stage` opened."""
    prepared.end_transaction(conn, commit)
