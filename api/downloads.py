"""CSV downloads that hold one chunk and no connection while the client reads
(docs/design.md, "Exports", downloads).

Each chunk is read through the owner's function, which checks the caller's token.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

from sqlalchemy.engine import Engine

from ledger import artifacts
from ledger.service import StoredCsv
from ledger.tokens import TokenOwner
from teamdesk import s3_store
from teamdesk.export_store import ObjectLocation, ObjectMissing

MAX_DOWNLOADS = 8
MAX_DOWNLOADS_PER_TOKEN = 2
RETRY_AFTER_S = 1
REDIRECT_TTL_S = 60  # a presigned URL's life (EXPORT_DOWNLOAD=redirect)
MSG_TOO_MANY_DOWNLOADS = "too many downloads in progress; try again after Retry-After seconds"


class Slots:
    """The downloads a process streams now, in all and per token."""

    def __init__(
        self, total: int = MAX_DOWNLOADS, per_token: int = MAX_DOWNLOADS_PER_TOKEN
    ) -> None:
        self.total, self.per_token = total, per_token
        self._lock = threading.Lock()
        self._held: Counter[uuid.UUID] = Counter()

    def take(self, token_id: uuid.UUID) -> bool:
        """Take a slot for ``token_id``; False when none is free (nothing taken)."""
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held[token_id] >= self.per_token:
                return False
            self._held[token_id] += 1
            return True

    def give_back(self, token_id: uuid.UUID) -> None:
        with self._lock:
            self._held[token_id] -= 1
            if self._held[token_id] <= 0:
                del self._held[token_id]

    def in_use(self) -> int:
        with self._lock:
            return sum(self._held.values())


def chunks(
    engine: Engine, stored: StoredCsv, token_hash: str, seq: int = 0, sent: int = 0
) -> Iterator[bytes]:
    """The CSV's chunks in order from ``seq`` (``sent`` bytes before it), each on a
    connection of its own; stops early when a chunk is gone or no longer visible."""
    while stored.size is None or sent < stored.size:
        with engine.connect() as conn:
            piece = artifacts.read_chunk(conn, token_hash, stored.task_id, stored.key, seq)
        if piece is None:
            return
        yield piece
        sent, seq = sent + len(piece), seq + 1


class Download:
    """A download's body: its chunks, and its slot given back exactly once - when the
    chunks end, fail, or the body is closed or dropped unread (a client gone before the
    first chunk was asked for leaves a generator that never ran its ``finally``)."""

    def __init__(self, pieces: Iterator[bytes], slots: Slots, token_id: uuid.UUID) -> None:
        self._pieces, self._slots, self._token_id = pieces, slots, token_id
        self._open = True

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._pieces)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._open:
            self._open = False
            self._slots.give_back(self._token_id)

    def __del__(self) -> None:
        self.close()


def object_of(engine: Engine, stored: StoredCsv, owner: TokenOwner) -> ObjectLocation | None:
    """Where the CSV is when an object store keeps it (None: its chunks), asked of the
    owner's function with the caller's token: the API's role cannot read it otherwise."""
    with engine.connect() as conn:
        return artifacts.object_of(conn, owner.token_hash, stored.task_id)


def redirect_url(location: ObjectLocation, task_id: uuid.UUID) -> str:
    """A presigned URL of the object, valid ``REDIRECT_TTL_S`` (EXPORT_DOWNLOAD=redirect)."""
    filename = f"export-{task_id}.csv"
    return s3_store.object_store().presign(location, REDIRECT_TTL_S, filename)


def start(
    engine: Engine,
    stored: StoredCsv,
    slots: Slots,
    owner: TokenOwner,
    location: ObjectLocation | None = None,
) -> Download | None:
    """The download of ``stored`` for ``owner``, whose slot the caller took: from its
    chunks, or from its object at ``location``. Its first chunk is read already, so a CSV
    that is gone (or no longer the owner's to see) answers 410 rather than an empty 200.
    None then, the slot given back. ObjectStoreError when the store fails (503)."""
    try:
        if location is None:
            with engine.connect() as conn:
                first = artifacts.read_chunk(conn, owner.token_hash, stored.task_id, stored.key, 0)
            rest: Iterator[bytes] = chunks(
                engine, stored, owner.token_hash, seq=1, sent=len(first or b"")
            )
        else:
            try:
                rest = s3_store.object_store().read(location, artifacts.CHUNK_BYTES)
            except ObjectMissing:
                rest = iter(())
            first = next(rest, None)
    except BaseException:
        slots.give_back(owner.token_id)
        raise
    if first is None:
        slots.give_back(owner.token_id)
        return None
    return Download(itertools.chain((first,), rest), slots, owner.token_id)
