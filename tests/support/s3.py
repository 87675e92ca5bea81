"""The S3 API server of harness/s3_server.py for a test process: the AWS variables set
while a block runs, and the product's per-process client made again from them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from harness.s3_server import S3Server, s3_server
from teamdesk import s3_store

__all__ = ["S3Server", "s3_environment", "s3_server"]


@contextmanager
def s3_environment(server: S3Server) -> Iterator[None]:
    """The AWS variables set for this process while the block runs, and its S3 client
    made again from them (teamdesk/export_store.py keeps one per process)."""
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    s3_store.forget_object_store()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3_store.forget_object_store()
