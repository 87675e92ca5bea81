"""A real S3 API server for tests and the bench: moto's standalone server over HTTP on
127.0.0.1 (a process of its own, on a free port), reached by the product's own client
(boto3) through the standard AWS variables. The product's code knows nothing of moto."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import boto3

from harness.processes import end_process, free_port
from harness.waiting import wait_for

START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """The standard variables a process of the cluster reads (teamdesk/s3_store.py)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "teamdesk-test",
            "AWS_SECRET_ACCESS_KEY": "teamdesk-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A client of the test's own (what an operator's aws CLI would see)."""
        env = self.env
        return boto3.session.Session().client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self) -> str:
        name = f"td-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=bucket)
        return sorted(item["Key"] for item in listed.get("Contents", []))

    def open_uploads(self, bucket: str) -> list[str]:
        listed = self.client().list_multipart_uploads(Bucket=bucket)
        return sorted(u["Key"] for u in listed.get("Uploads", []))


@contextmanager
def s3_server(*, require_auth: bool = False) -> Iterator[S3Server]:
    """moto's server, until the block ends. ``require_auth``: it refuses every request
    whose credentials it does not know (as a real store does; by default it takes any)."""
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = dict(os.environ)
    if require_auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 server exited ({process.returncode})")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
        except (urllib.error.URLError, ConnectionError):
            return False
        return True

    try:
        wait_for(answers, START_TIMEOUT_S, 0.1, "the S3 server to answer")
        yield S3Server(endpoint)
    finally:
        end_process(process)
