"""A private Redis under Sentinel: a master, one replica and three sentinels, every one a
``redis-server`` (Debian's; ``--sentinel`` for the sentinels) on a free 127.0.0.1 port,
without persistence. The soak's Redis (soak/run.py: its Redis faults act on whichever
server is the master now) and the tests that fail a master over
(tests/process/test_redis_sentinel.py); never the shared Redis on 6379.

Roles move: :attr:`SentinelGroup.master_port` and :attr:`SentinelGroup.replica_port`
always name the current ones, as the sentinels report them.

- :meth:`SentinelGroup.kill_master`: SIGKILL the master (what it had not replicated is
  lost) and wait until every sentinel names the replica as the master and it says so
  itself; the old master stays down.
- :meth:`SentinelGroup.failover`: the same, then the old master's port starts again as a
  replica of the new master (``--replicaof``, empty: no persistence) and the group waits
  until it is whole again (below), ready for the next failover.
- :meth:`SentinelGroup.restart_master`: stop the master and start it again on its port,
  empty, as the master. An outage shorter than ``down_after_ms`` is a reboot to the
  sentinels, not a failure: no failover, and the replica resyncs from the empty master
  (it is emptied too). Should the sentinels have failed over meanwhile after all (a
  slow machine), the roles follow what they say and the restarted server is made a
  replica (:meth:`SentinelGroup.restart_master` returns True then).

*Whole*: the replica replicates from the master, its link up and its sync done; every
sentinel names that master, knows the other two sentinels and sees the replica up (not
subjectively down). Without the sentinels' view the next failover could find no replica
it may promote. (Their view of the replica's link comes from INFO every 10 s, so it is
not waited for: a promotion does not need it fresh.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis

from harness.processes import free_port
from teamdesk.config import Settings
from teamdesk.redis_client import redis_client

MASTER_NAME = "teamdesk-test"
SENTINELS = 3
QUORUM = 2
DOWN_AFTER_MS = 1000  # the sentinels call a silent master down after this long
FAILOVER_TIMEOUT_MS = 5000
READY_TIMEOUT_S = 30.0  # starting up, or a failover: seconds, not this long
STOP_WAIT_S = 10.0
POLL_S = 0.1


class SentinelGroup:
    """The group's processes and the current roles. ``start`` brings it up; ``stop``
    ends every process it started."""

    def __init__(
        self, workdir: Path, master_name: str = MASTER_NAME, down_after_ms: int = DOWN_AFTER_MS
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary, self.workdir = binary, workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.master_name, self.down_after_ms = master_name, down_after_ms
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(SENTINELS)]
        self.servers: dict[int, subprocess.Popen[bytes]] = {}  # by port: the data servers
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.starts = 0  # data-server starts

    def url(self, db: int = 0) -> str:
        """kombu's form: every sentinel, separated by ``;``, the database on the first."""
        first, *rest = (f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports)
        return ";".join([f"{first}/{db}", *rest])

    def client(self, timeout_s: float) -> redis.Redis:
        """A client of the current master through the sentinels, made as every process of
        the cluster makes its own (teamdesk.redis_client); answers are bytes."""
        url = self.url()
        settings = Settings(redis_url=url, broker_url=url, redis_sentinel_master=self.master_name)
        return redis_client(settings, url, timeout_s)

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return _direct(self.sentinel_ports[index])

    def master_client(self) -> redis.Redis:
        return _direct(self.master_port)

    # ---- life ---------------------------------------------------------------------------
    def start(self) -> None:
        """The master, its replica, the sentinels; returns once the group is whole."""
        self._serve(self.master_port)
        self._serve(self.replica_port, replica_of=self.master_port)
        # A sentinel learns of the replica from the master's INFO: at once if it is
        # attached by then, else at the next INFO, 10 s later.
        _wait(lambda: _info(self.replica_port).get("master_link_status") == "up", "the replica")
        self.sentinels = [self._sentinel(port) for port in self.sentinel_ports]
        _wait(self._whole, "the sentinel group to form")

    def stop(self) -> None:
        for process in [*self.servers.values(), *self.sentinels]:
            _stop(process, signal.SIGTERM)

    # ---- faults -------------------------------------------------------------------------
    def kill_master(self) -> float:
        """SIGKILL the master, wait until the sentinels promote the replica; seconds that
        took. The old master stays down."""
        old, new = self.master_port, self.replica_port
        started = time.monotonic()
        _stop(self.servers.pop(old), signal.SIGKILL)
        _wait(lambda: self.reported_master_ports() == {new}, "the sentinels to promote")
        _wait(lambda: _role(new) == "master", "the new master")
        self.master_port, self.replica_port = new, old
        return time.monotonic() - started

    def failover(self) -> tuple[float, float]:
        """:meth:`kill_master`, then the old master's port again as a replica of the new
        one; (seconds to the promotion, seconds from the old port's start to a whole group)."""
        promoted_s = self.kill_master()
        started = time.monotonic()
        self._serve(self.replica_port, replica_of=self.master_port)
        _wait(self._whole, "the old master to rejoin as an in-sync replica")
        return promoted_s, time.monotonic() - started

    def restart_master(self, sig: signal.Signals, down_s: float) -> bool:
        """Stop the master with ``sig``, stay down ``down_s``, start it again empty on its
        port; returns once the group is whole. True when the sentinels failed over
        meanwhile (the outage outlasted ``down_after_ms``)."""
        port = self.master_port
        _stop(self.servers.pop(port), sig)
        time.sleep(down_s)  # the outage itself
        self._serve(port)
        _wait(lambda: len(self.reported_master_ports()) == 1, "the sentinels to agree")
        (reported,) = self.reported_master_ports()
        if reported != port:  # failed over: the restarted server must follow the new master
            self.master_port, self.replica_port = reported, port
            _wait(lambda: _replicate(port, reported), "the restarted server to follow")
        _wait(self._whole, "the replica to resync")
        return reported != port

    # ---- what the group says -------------------------------------------------------------
    def reported_master_ports(self) -> set[int]:
        """The master's port as each sentinel reports it now (unanswered: left out)."""
        ports: set[int] = set()
        for index in range(len(self.sentinel_ports)):
            client = self.sentinel_client(index)
            try:
                address: Any = client.sentinel_get_master_addr_by_name(self.master_name)
                ports.add(int(address[1]))
            except (redis.RedisError, TypeError):
                pass
            finally:
                client.close()
        return ports

    def _whole(self) -> bool:
        info = _info(self.replica_port)
        if info.get("master_port") != self.master_port or info.get("master_link_status") != "up":
            return False
        if info.get("master_sync_in_progress") != 0:
            return False
        return all(self._sentinel_sees_whole(index) for index in range(SENTINELS))

    def _sentinel_sees_whole(self, index: int) -> bool:
        client = self.sentinel_client(index)
        try:
            master: Any = client.sentinel_master(self.master_name)
            replicas: Any = client.sentinel_slaves(self.master_name)
        finally:
            client.close()
        if int(master["port"]) != self.master_port:
            return False
        if int(master["num-other-sentinels"]) < SENTINELS - 1:
            return False
        return any(_replica_up(r, self.replica_port) for r in replicas)

    # ---- processes ----------------------------------------------------------------------
    def _serve(self, port: int, replica_of: int | None = None) -> None:
        """Start a data server on ``port``, empty: its directory is made anew (a replica
        writes the RDB of each full sync there, and a server loads what it finds there).
        A full sync starts at once (Redis waits 5 s for more replicas by default)."""
        self.starts += 1
        data = self.workdir / f"data-{port}"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        args = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(data), "--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        log = (self.workdir / f"redis-{port}.{self.starts}.log").open("wb")
        self.servers[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait(lambda: _answers(port), f"redis-server on port {port} to answer")

    def _sentinel(self, port: int) -> subprocess.Popen[bytes]:
        config = self.workdir / f"sentinel-{port}.conf"  # a sentinel rewrites its own file
        name = self.master_name
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {name} 127.0.0.1 {self.master_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        log = (self.workdir / f"sentinel-{port}.log").open("wb")
        process = subprocess.Popen(
            [self.binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        return process


def _replica_up(state: Any, port: int) -> bool:
    """A sentinel's entry for the replica on ``port`` says it is up."""
    if int(state["port"]) != port:
        return False
    return not (state.get("is_sdown") or state.get("is_odown") or state.get("is_disconnected"))


def _direct(port: int) -> redis.Redis:
    return redis.Redis(port=port, decode_responses=True, socket_timeout=2, socket_connect_timeout=2)


def _answers(port: int) -> bool:
    client = _direct(port)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _info(port: int) -> dict[str, Any]:
    client = _direct(port)
    try:
        return dict(client.info("replication"))
    finally:
        client.close()


def _role(port: int) -> str:
    return str(_info(port)["role"])


def _replicate(port: int, master_port: int) -> bool:
    """Make the server on ``port`` a replica of ``master_port`` (once it is not yet one)."""
    if _info(port).get("master_port") != master_port:
        client = _direct(port)
        try:
            client.replicaof("127.0.0.1", master_port)
        finally:
            client.close()
    return _role(port) == "slave"


def _wait(condition: Callable[[], object], what: str) -> None:
    """Poll ``condition`` (a readiness check, not an ordering wait) for READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with suppress(redis.RedisError, OSError):
            if condition():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def _stop(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` (after a SIGCONT: it may be frozen) and wait for the exit."""
    if process.poll() is not None:
        return
    with suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)
        os.kill(process.pid, sig)
    try:
        process.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_WAIT_S)


@contextmanager
def sentinel_group(down_after_ms: int = DOWN_AFTER_MS) -> Iterator[SentinelGroup]:
    """A group in a temporary directory, whole; every process stopped after."""
    workdir = Path(tempfile.mkdtemp(prefix="tdt-sentinel-"))
    group = SentinelGroup(workdir, down_after_ms=down_after_ms)
    try:
        group.start()
        yield group
    finally:
        group.stop()
        shutil.rmtree(workdir, ignore_errors=True)
