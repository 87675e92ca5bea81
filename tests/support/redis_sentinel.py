"""A private Redis under Sentinel: a master, one replica and three sentinels, all
``redis-server`` (Debian's, ``--sentinel`` for the sentinels) on free local ports, no
persistence. For tests that fail the master over; never the shared Redis on 6379.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.support.redis_server import free_port, stop

MASTER_NAME = "teamdesk-test"
SENTINELS = 3
QUORUM = 2
DOWN_AFTER_MS = 1000  # the sentinels call a silent master down after this long
FAILOVER_TIMEOUT_MS = 5000
READY_TIMEOUT_S = 30.0  # starting up, or a failover: seconds, not this long


@dataclass
class SentinelGroup:
    """The running group; ``master_port`` follows failovers."""

    workdir: Path
    master: subprocess.Popen[bytes]
    master_port: int
    replica: subprocess.Popen[bytes]
    replica_port: int
    sentinel_ports: list[int]
    sentinels: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def url(self, db: int = 0) -> str:
        """kombu's form: every sentinel, separated by ``;``, the database on the first."""
        first, *rest = (f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports)
        return ";".join([f"{first}/{db}", *rest])

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], decode_responses=True, socket_timeout=2)

    def master_client(self) -> redis.Redis:
        return redis.Redis(port=self.master_port, decode_responses=True, socket_timeout=2)

    def reported_master_ports(self) -> set[int]:
        """The master's port as each sentinel reports it now (unanswered: left out)."""
        ports: set[int] = set()
        for index in range(len(self.sentinel_ports)):
            client = self.sentinel_client(index)
            try:
                address: Any = client.sentinel_get_master_addr_by_name(MASTER_NAME)
                ports.add(int(address[1]))
            except (redis.RedisError, TypeError):
                pass
            finally:
                client.close()
        return ports

    def kill_master(self) -> None:
        """SIGKILL the master (its unreplicated writes are lost), wait until every
        sentinel names the replica as the master, and return; the old master stays down."""
        old, new = self.master_port, self.replica_port
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(timeout=10)
        _wait(lambda: self.reported_master_ports() == {new}, "the sentinels to promote")
        client = redis.Redis(port=new, decode_responses=True, socket_timeout=2)
        try:
            _wait(lambda: client.info("replication")["role"] == "master", "the new master")
        finally:
            client.close()
        self.master, self.master_port = self.replica, new
        self.replica_port = old


def _wait(condition: object, what: str) -> None:
    """Poll ``condition`` (a readiness check, not an ordering wait) for READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with suppress(redis.RedisError, OSError):
            if condition():  # type: ignore[operator]
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _server(binary: str, workdir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", str(workdir), *extra]
    log = (workdir / f"redis-{port}.log").open("wb")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _sentinel(binary: str, workdir: Path, port: int, master_port: int) -> subprocess.Popen[bytes]:
    config = workdir / f"sentinel-{port}.conf"  # a sentinel rewrites its own file
    config.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
        f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {QUORUM}\n"
        f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
        f"sentinel parallel-syncs {MASTER_NAME} 1\n"
    )
    log = (workdir / f"sentinel-{port}.log").open("wb")
    return subprocess.Popen(
        [binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
    )


def _ready(group: SentinelGroup) -> bool:
    """Every sentinel knows the master, its replica and the other sentinels, and the
    replica is in sync."""
    replica = redis.Redis(port=group.replica_port, decode_responses=True, socket_timeout=2)
    try:
        if replica.info("replication").get("master_link_status") != "up":
            return False
    finally:
        replica.close()
    for index in range(len(group.sentinel_ports)):
        client = group.sentinel_client(index)
        try:
            state: Any = client.sentinel_master(MASTER_NAME)
        finally:
            client.close()
        if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < SENTINELS - 1:
            return False
    return True


@contextmanager
def sentinel_group() -> Iterator[SentinelGroup]:
    """Start the group, wait until it is whole, yield it; stop every process after."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="tdt-sentinel-"))
    master_port, replica_port = free_port(), free_port()
    master = _server(binary, workdir, master_port)
    replica = _server(binary, workdir, replica_port, "--replicaof", "127.0.0.1", str(master_port))
    group = SentinelGroup(
        workdir=workdir,
        master=master,
        master_port=master_port,
        replica=replica,
        replica_port=replica_port,
        sentinel_ports=[free_port() for _ in range(SENTINELS)],
    )
    try:
        group.sentinels = [
            _sentinel(binary, workdir, port, master_port) for port in group.sentinel_ports
        ]
        _wait(lambda: _ready(group), "the sentinel group to form")
        yield group
    finally:
        for process in [group.master, group.replica, *group.sentinels]:
            stop(process)
        shutil.rmtree(workdir, ignore_errors=True)
