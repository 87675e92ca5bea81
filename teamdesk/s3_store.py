"""The S3-compatible object store behind ``EXPORT_STORE=s3://...``, configured by the
standard AWS variables (docs/design.md, "Exports"; docs/decisions.md, "S3 client: boto3").
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from teamdesk.config import Settings
from teamdesk.export_store import (
    EXPORTS_FOLDER,
    ObjectLocation,
    ObjectMissing,
    ObjectStoreError,
    OpenUpload,
    StoredObject,
    StoreTarget,
    names_of,
    object_key,
    parse_store,
)

PART_BYTES = 8 << 20  # S3's parts are 5 MiB at least (but the last)
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 20
MAX_ATTEMPTS = 2
DELETE_BATCH = 1000  # S3's DeleteObjects takes at most 1000 keys
CSV_TYPE = "text/csv; charset=utf-8"

log = logging.getLogger("teamdesk.s3_store")

_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


def _failure(action: str, exc: BaseException) -> ObjectStoreError:
    """What went wrong, without a credential: the error's class and S3's code."""
    code = ""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = f" ({exc.response.get('Error', {}).get('Code', '')})"
    return ObjectStoreError(f"object store: {action} failed: {type(exc).__name__}{code}")


class S3Writer:
    """One execution's upload under its own key (teamdesk/export_store.py ``object_key``)."""

    def __init__(
        self, client: Any, target: StoreTarget, task_id: uuid.UUID, execution_id: uuid.UUID
    ) -> None:
        self.client = client
        self.location = ObjectLocation(target.bucket, object_key(target, task_id, execution_id))
        self.buffer = bytearray()
        self.size = 0
        self._sha256 = hashlib.sha256()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._pending: Future[dict[str, Any]] | None = None
        self._sender: ThreadPoolExecutor | None = None
        self._finished = False

    def write(self, conn_of: object, data: bytes) -> None:
        self.buffer += data
        self.size += len(data)
        self._sha256.update(data)
        while len(self.buffer) >= PART_BYTES:
            piece = bytes(self.buffer[:PART_BYTES])
            del self.buffer[:PART_BYTES]
            self._send_part(piece)

    def _send_part(self, piece: bytes) -> None:
        """Hand ``piece`` to the sender thread once the part before it is acknowledged."""
        loc = self.location
        try:
            if self._upload_id is None:
                created = self.client.create_multipart_upload(
                    Bucket=loc.bucket, Key=loc.key, ContentType=CSV_TYPE
                )
                self._upload_id = str(created["UploadId"])
                self._sender = ThreadPoolExecutor(1, thread_name_prefix="teamdesk-s3-upload")
            self._collect()
        except _ERRORS as exc:
            raise _failure("upload", exc) from exc
        number = len(self._parts) + 1
        assert self._sender is not None
        self._pending = self._sender.submit(self._upload_part, number, piece)

    def _upload_part(self, number: int, piece: bytes) -> dict[str, Any]:
        loc = self.location
        sent = self.client.upload_part(
            Bucket=loc.bucket, Key=loc.key, UploadId=self._upload_id, PartNumber=number, Body=piece
        )
        return {"PartNumber": number, "ETag": sent["ETag"]}

    def _collect(self) -> None:
        """Wait for the part in flight, if any (its error is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._parts.append(pending.result())

    def finish_upload(self) -> tuple[int, int, str]:
        """The rest, then the object: its size, its parts, its SHA-256."""
        loc = self.location
        try:
            if self._upload_id is None:
                self.client.put_object(
                    Bucket=loc.bucket, Key=loc.key, Body=bytes(self.buffer), ContentType=CSV_TYPE
                )
            else:
                if self.buffer:
                    self._send_part(bytes(self.buffer))
                self._collect()
                self.client.complete_multipart_upload(
                    Bucket=loc.bucket,
                    Key=loc.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        except _ERRORS as exc:
            raise _failure("upload", exc) from exc
        finally:
            self._stop_sender()
        self.buffer = bytearray()
        self._finished = True
        return self.size, max(1, len(self._parts)), self._sha256.hexdigest()

    def abort(self) -> None:
        """Remove what this execution uploaded: the object once finished, else the open
        multipart upload. Best effort: what is left, the dispatcher's sweep removes."""
        loc = self.location
        self._stop_sender()
        try:
            if self._finished:
                self.client.delete_object(Bucket=loc.bucket, Key=loc.key)
            elif self._upload_id is not None:
                self.client.abort_multipart_upload(
                    Bucket=loc.bucket, Key=loc.key, UploadId=self._upload_id
                )
        except _ERRORS as exc:
            log.warning(
                "object store: could not remove an execution's upload (the sweep will)",
                extra={"key": loc.key, "error": str(_failure("abort", exc))},
            )

    def _stop_sender(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True, cancel_futures=True)
            self._sender = None


class S3Store:
    """The process's client (teamdesk/export_store.py ``object_store``): thread-safe, as
    boto3's clients are."""

    def __init__(self, client: Any | None = None) -> None:
        config = botocore.config.Config(
            signature_version="s3v4",
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
        )
        self.client = client or boto3.session.Session().client("s3", config=config)

    def writer(self, target: StoreTarget, task_id: uuid.UUID, execution_id: uuid.UUID) -> S3Writer:
        return S3Writer(self.client, target, task_id, execution_id)

    def read(self, location: ObjectLocation, chunk_bytes: int) -> Iterator[bytes]:
        """The object's bytes, ``chunk_bytes`` at a time, as they arrive. The request is
        sent before the first chunk is asked for (a missing object raises at once)."""
        try:
            got = self.client.get_object(Bucket=location.bucket, Key=location.key)
        except self.client.exceptions.NoSuchKey:
            raise ObjectMissing(f"object store: no object {location.key}") from None
        except _ERRORS as exc:
            raise _failure("read", exc) from exc
        return self._chunks(got["Body"], chunk_bytes)

    @staticmethod
    def _chunks(body: Any, chunk_bytes: int) -> Iterator[bytes]:
        try:
            yield from body.iter_chunks(chunk_bytes)
        except _ERRORS as exc:
            raise _failure("read", exc) from exc
        finally:
            body.close()

    def presign(self, location: ObjectLocation, ttl_s: int, filename: str) -> str:
        """A URL that GETs the object for ``ttl_s`` seconds, as an attachment."""
        try:
            return str(
                self.client.generate_presigned_url(
                    "get_object",
                    Params={
                        "Bucket": location.bucket,
                        "Key": location.key,
                        "ResponseContentDisposition": f'attachment; filename="{filename}"',
                        "ResponseContentType": CSV_TYPE,
                        "ResponseCacheControl": "no-store",
                    },
                    ExpiresIn=ttl_s,
                )
            )
        except _ERRORS as exc:
            raise _failure("presign", exc) from exc

    def delete(self, locations: list[ObjectLocation]) -> None:
        """Delete these objects (a missing one is no error)."""
        by_bucket: dict[str, list[str]] = {}
        for loc in locations:
            by_bucket.setdefault(loc.bucket, []).append(loc.key)
        try:
            for bucket, keys in by_bucket.items():
                for start in range(0, len(keys), DELETE_BATCH):
                    batch = keys[start : start + DELETE_BATCH]
                    answer = self.client.delete_objects(
                        Bucket=bucket,
                        Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                    )
                    if answer.get("Errors"):
                        codes = sorted({e.get("Code", "") for e in answer["Errors"]})
                        raise ObjectStoreError(f"object store: delete failed: {', '.join(codes)}")
        except _ERRORS as exc:
            raise _failure("delete", exc) from exc

    def list_exports(
        self, target: StoreTarget, after: str, limit: int
    ) -> tuple[list[StoredObject], str]:
        """Up to ``limit`` keys under the target's exports folder after ``after``, in key
        order: the export objects among them, and the last key listed ("" when none was:
        the listing is at its end)."""
        params: dict[str, Any] = {
            "Bucket": target.bucket,
            "Prefix": target.prefix + EXPORTS_FOLDER,
            "MaxKeys": limit,
        }
        if after:
            params["StartAfter"] = after
        try:
            listed = self.client.list_objects_v2(**params)
        except _ERRORS as exc:
            raise _failure("list", exc) from exc
        items = listed.get("Contents", [])
        found = []
        for item in items:
            names = names_of(item["Key"])
            if names is not None:
                location = ObjectLocation(target.bucket, item["Key"])
                found.append(StoredObject(location, *names, item["LastModified"]))
        return found, items[-1]["Key"] if items else ""

    def open_uploads(self, target: StoreTarget, limit: int) -> list[OpenUpload]:
        """Up to ``limit`` multipart uploads under the target's prefix not yet completed or
        aborted."""
        try:
            listed = self.client.list_multipart_uploads(
                Bucket=target.bucket, Prefix=target.prefix + EXPORTS_FOLDER, MaxUploads=limit
            )
        except _ERRORS as exc:
            raise _failure("list uploads", exc) from exc
        return [
            OpenUpload(ObjectLocation(target.bucket, u["Key"]), u["UploadId"], u["Initiated"])
            for u in listed.get("Uploads", [])
        ]

    def abort_upload(self, upload: OpenUpload) -> None:
        loc = upload.location
        try:
            self.client.abort_multipart_upload(
                Bucket=loc.bucket, Key=loc.key, UploadId=upload.upload_id
            )
        except _ERRORS as exc:
            raise _failure("abort", exc) from exc


_stores: dict[int, S3Store] = {}
_stores_lock = threading.Lock()


def object_store() -> S3Store:
    """This process's client (made at the first need; one per process, never shared
    across a fork: a client's connections are its own process's)."""
    pid = os.getpid()
    with _stores_lock:
        store = _stores.get(pid)
        if store is None:
            store = _stores[pid] = S3Store()
        return store


def forget_object_store() -> None:
    """Drop this process's client: the next need makes one from the environment as it is
    then (tests that start their own S3 server)."""
    with _stores_lock:
        _stores.pop(os.getpid(), None)


PROBE_KEY = "exports/.teamdesk-start-check"  # never written: reading it needs no right
PROBE_CONNECT_TIMEOUT_S = 5
PROBE_READ_TIMEOUT_S = 10


def unusable(settings: Settings) -> str | None:
    """Why ``EXPORT_STORE`` cannot be used, in one line, or None, from reading a key nobody
    writes: "no such key" (or "access denied", for a role that may not list the bucket)
    means the endpoint, bucket and credentials are fine."""
    try:
        target = parse_store(settings.export_store)
    except ValueError as exc:
        return str(exc)
    if target is None:
        return None
    where = f"EXPORT_STORE={target.url}"
    config = botocore.config.Config(
        signature_version="s3v4",
        connect_timeout=PROBE_CONNECT_TIMEOUT_S,
        read_timeout=PROBE_READ_TIMEOUT_S,
        retries={"max_attempts": 1, "mode": "standard"},
    )
    try:
        client = boto3.session.Session().client("s3", config=config)
    except ValueError as exc:  # an empty or malformed AWS_DEFAULT_REGION, AWS_ENDPOINT_URL
        return f"{where}: the AWS settings do not make an endpoint ({exc})"
    endpoint = client.meta.endpoint_url
    try:
        client.get_object(Bucket=target.bucket, Key=target.prefix + PROBE_KEY)
    except botocore.exceptions.NoCredentialsError:
        return (
            f"{where}: no AWS credentials were found (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or a role)"
        )
    except botocore.exceptions.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "AccessDenied", "403"):
            return None
        if code == "NoSuchBucket":
            return f"{where}: bucket {target.bucket} does not exist"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"):
            return (
                f"{where}: the object store at {endpoint} does not accept these credentials "
                f"({code}): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the role"
            )
        return f"{where}: the object store at {endpoint} answered {code or 'an error'}"
    except botocore.exceptions.EndpointConnectionError:
        return f"{where}: the object store at {endpoint} cannot be reached"
    except botocore.exceptions.BotoCoreError as exc:
        return f"{where}: the object store at {endpoint} did not answer ({type(exc).__name__})"
    return None


def store_or_exit(settings: Settings, command: str) -> None:
    """For a process's start: one line on stderr and exit 2 when the store cannot be used."""
    problem = unusable(settings)
    if problem is not None:
        print(f"{command}: configuration error: {problem}", file=sys.stderr)
        raise SystemExit(2)
