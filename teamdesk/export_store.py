"""Where an export's CSV is kept, by ``EXPORT_STORE`` (docs/design.md, "Exports"): the
interface the worker, the API and the dispatcher use (names, keys, calls), which
teamdesk/s3_store.py implements with boto3.
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

POSTGRES = "postgres"
SCHEME = "s3://"
KEY_RANDOM_BYTES = 16  # the key's unguessable part: 128 bits
EXPORTS_FOLDER = "exports/"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_KEY = re.compile(
    r"(?P<prefix>.*)" + EXPORTS_FOLDER + r"(?P<task>[0-9a-f-]{36})/(?P<execution>[0-9a-f-]{36})"
    r"-[0-9a-f]{" + str(2 * KEY_RANDOM_BYTES) + r"}\.csv"
)

MSG_STORE = (
    "EXPORT_STORE must be 'postgres' or 's3://BUCKET[/PREFIX]' (a bucket name of 3-63 "
    "lower-case letters, digits, dots and hyphens; a prefix of letters, digits, '.', '_', "
    "'-' and '/'), got {value!r}"
)


class ObjectStoreError(Exception):
    """The object store refused or could not be reached (its error class and code are in
    the message; never a credential)."""


class ObjectMissing(ObjectStoreError):
    """The object is not in the store (deleted, or by the bucket's lifecycle rule)."""


@dataclass(frozen=True)
class StoreTarget:
    """Where new CSVs go: a bucket and a key prefix (empty, or ending in ``/``)."""

    bucket: str
    prefix: str = ""

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class ObjectLocation:
    """One object: its bucket and key, as ``s3://BUCKET/KEY`` in the ledger row."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        if not url.startswith(SCHEME) or "/" not in url[len(SCHEME) :]:
            raise ValueError(f"not an object's location: {url!r}")
        bucket, key = url[len(SCHEME) :].split("/", 1)
        return cls(bucket, key)


@dataclass(frozen=True)
class StoredObject:
    """An object found in the store (a listing), with the task and execution its key names."""

    location: ObjectLocation
    task_id: uuid.UUID
    execution_id: uuid.UUID
    modified: datetime


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload never completed nor aborted (an execution that crashed)."""

    location: ObjectLocation
    upload_id: str
    initiated: datetime


def parse_store(value: str) -> StoreTarget | None:
    """``EXPORT_STORE``: None for ``postgres``, else the bucket and prefix. ValueError (with
    :data:`MSG_STORE`) for anything else."""
    text = value.strip()
    if text.lower() in ("", POSTGRES):
        return None
    if not text.startswith(SCHEME):
        raise ValueError(MSG_STORE.format(value=value))
    bucket, _, prefix = text[len(SCHEME) :].partition("/")
    segments = [s for s in prefix.split("/") if s]
    named = all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments)
    if not _BUCKET.fullmatch(bucket) or not named:
        raise ValueError(MSG_STORE.format(value=value))
    return StoreTarget(bucket, "".join(f"{s}/" for s in segments))


def object_key(target: StoreTarget, task_id: uuid.UUID, execution_id: uuid.UUID) -> str:
    """The key an execution uploads its CSV under: its task, itself, 128 random bits."""
    random = secrets.token_hex(KEY_RANDOM_BYTES)
    return f"{target.prefix}{EXPORTS_FOLDER}{task_id}/{execution_id}-{random}.csv"


def names_of(key: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The task and execution a key of :func:`object_key` names; None for any other key."""
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    return uuid.UUID(match["task"]), uuid.UUID(match["execution"])


class ObjectWriter(Protocol):
    """An execution's upload: bytes in as the read streams, the object at :meth:`finish`;
    :meth:`abort` removes what was uploaded (before or after finish). The same calls as
    ledger.artifacts.ChunkWriter's (``conn_of``/``conn`` unused)."""

    location: ObjectLocation

    def write(self, conn_of: object, data: bytes) -> None: ...

    def finish_upload(self) -> tuple[int, int, str]: ...  # size, parts, sha256

    def abort(self) -> None: ...
