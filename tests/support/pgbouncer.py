"""A real PgBouncer (Debian's ``pgbouncer``) in transaction pooling, on a port of its own,
in front of the test PostgreSQL. PgBouncer refuses to run as root: as root it runs as
the ``postgres`` user. ``make test`` installs it (scripts/ensure_debian.sh)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.processes import end_process

START_TIMEOUT_S = 10.0
SERVICE_USER = "postgres"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(
    directory: Path,
    port: int,
    target_port: int,
    pool_size: int,
    query_wait_timeout_s: int | None,
) -> Path:
    (directory / "users.txt").write_text(f'"{SERVICE_USER}" ""\n')
    extra = "" if query_wait_timeout_s is None else f"query_wait_timeout = {query_wait_timeout_s}\n"
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port={target_port}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        f"admin_users = {SERVICE_USER}\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {pool_size}\n"
        "max_client_conn = 500\n"
        "server_reset_query =\n" + extra
    )
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    return ini


@contextmanager
def pgbouncer(
    target_port: int = 5432, pool_size: int = 4, query_wait_timeout_s: int | None = None
) -> Iterator[int]:
    """Run PgBouncer until the block ends; yields its port. ``pool_size`` server
    connections per database and user: fewer than the clients, so clients share them.
    ``query_wait_timeout_s``: how long a client's query may wait in PgBouncer's queue for
    a server connection before PgBouncer drops it (PgBouncer's default, 120 s, when
    None). Its files live in a directory of its own the service user can read (pytest's
    ``tmp_path`` is private to root)."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    directory = Path(tempfile.mkdtemp(prefix="td-pgbouncer-"))
    port = _free_port()
    ini = _config(directory, port, target_port, pool_size, query_wait_timeout_s)
    command = [binary, str(ini)]
    if os.geteuid() == 0:
        command = ["runuser", "-u", SERVICE_USER, "--", *command]
    log = (directory / "pgbouncer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(port, process, directory)
        yield port
    finally:
        end_process(process)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


def _wait_listening(port: int, process: subprocess.Popen[bytes], directory: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {(directory / 'pgbouncer.log').read_text()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)  # polling for the port to open, bounded by the deadline
    raise RuntimeError(f"pgbouncer did not listen on {port}")
