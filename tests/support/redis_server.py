"""A dedicated ``redis-server`` on a free local port, for tests that freeze Redis.

Never freeze the shared Redis on 6379: other tests (and people) use it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

START_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int
    args: tuple[str, ...] = ()
    password: str | None = None  # the default user's, when the server's users need one

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=self.password, decode_responses=True, socket_timeout=2
        )

    def restart(self, down_s: float = 0.0) -> None:
        """Stop the server (everything in it is lost: no persistence), stay down for
        ``down_s``, then start it again on the same port and wait until it answers."""
        stop(self.process)
        time.sleep(down_s)  # the outage itself, not an ordering wait
        self.process = subprocess.Popen(
            list(self.args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_until_answering(self)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP the server: it still accepts TCP connections but answers nothing."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_answering(server: RedisServer) -> None:
    client = server.client()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if server.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("dedicated redis-server did not start") from None
                time.sleep(0.05)  # polling for readiness, not ordering
    finally:
        client.close()


@contextmanager
def dedicated_redis(*extra_args: str, password: str | None = None) -> Iterator[RedisServer]:
    """Start ``redis-server`` on 127.0.0.1:<free port>, no persistence; stop it after.
    ``extra_args`` are more options (``--aclfile PATH``); ``password`` is the default
    user's when they set one."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    workdir = tempfile.mkdtemp(prefix="tdt-redis-")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", workdir, *extra_args]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(process=process, port=port, args=tuple(args), password=password)
    try:
        _wait_until_answering(server)
        yield server
    finally:
        stop(server.process)
        shutil.rmtree(workdir, ignore_errors=True)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a redis-server process (thawed first if frozen)."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGCONT)
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
