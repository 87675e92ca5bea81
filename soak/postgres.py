"""The soak's own PostgreSQL server, so that ``pgrestart`` restarts nothing shared.

A private cluster made with ``initdb`` under the soak's temporary directory, on a free
127.0.0.1 port, started and restarted with ``pg_ctl``. The machine's PostgreSQL on 5432 is
never touched. initdb refuses to run as root; then every ``initdb`` / ``pg_ctl`` runs as
the ``postgres`` user (``runuser -u postgres --``), and the data directory is theirs.

Settings: ``fsync = off`` and ``full_page_writes = off`` (the host never crashes in a soak,
only the server is stopped, and the kernel keeps every write; the shared machine's disk is
spared), ``max_connections`` for three workers, beat and the soak with room to spare.
``synchronous_commit`` stays on: an ``immediate`` stop still loses what the product commits
asynchronously (its claims and progress), as a real crash would.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path

import psycopg2

from harness.processes import free_port

SUPERUSER = "postgres"
START_TIMEOUT_S = 60
MAX_CONNECTIONS = 300
SERVER_OPTIONS = ("fsync=off", "full_page_writes=off", f"max_connections={MAX_CONNECTIONS}")
ANSWER_TIMEOUT_S = 30.0


def _bindir() -> Path:
    """Where initdb and pg_ctl live: pg_config's answer, else the newest Debian cluster."""
    found = shutil.which("pg_config")
    if found:
        out = subprocess.run([found, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    for path in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(path) / "initdb").exists():
            return Path(path)
    raise SystemExit("soak: initdb and pg_ctl not found (pg_config --bindir, /usr/lib/postgresql)")


class SoakPostgres:
    """``extra_options``: more ``name=value`` server settings, after the soak's own."""

    def __init__(self, workdir: Path, extra_options: tuple[str, ...] = ()) -> None:
        self.options = SERVER_OPTIONS + extra_options
        self.port = free_port()
        self.home = workdir / "postgres"
        self.data = self.home / "data"
        self.bindir = _bindir()
        self.as_root = os.geteuid() == 0
        self.restarts = 0

    @property
    def admin_url(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self.as_root:
            command = ["runuser", "-u", SUPERUSER, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, check=check)

    def create(self) -> None:
        """initdb (as the postgres user when we are root), then start."""
        self.home.mkdir(parents=True)
        if self.as_root:
            # The soak's temporary directory is root's (0700): let postgres through to its own.
            os.chmod(self.home.parent, 0o711)
            entry = pwd.getpwnam(SUPERUSER)
            os.chown(self.home, entry.pw_uid, entry.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
            "--locale=C.UTF-8", "--no-sync",
        )  # fmt: skip
        self.start()

    def _options(self) -> str:
        sets = " ".join(f"-c {option}" for option in self.options)
        return f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 {sets}"

    def start(self) -> None:
        log = self.home / "server.log"
        self._run(
            "pg_ctl", "start", "-D", str(self.data), "-w", "-t", str(START_TIMEOUT_S),
            "-l", str(log), "-o", self._options(),
        )  # fmt: skip
        self.wait_answering()

    def stop(self, mode: str = "fast") -> None:
        """``fast`` (sessions ended, a checkpoint) or ``immediate`` (no checkpoint: crash
        recovery at the next start)."""
        self._run("pg_ctl", "stop", "-D", str(self.data), "-w", "-m", mode, check=False)

    def restart(self, mode: str, down_s: float) -> None:
        self.restarts += 1
        self.stop(mode)
        time.sleep(down_s)
        self.start()

    def wait_answering(self) -> None:
        """Until the server takes connections (after a start, or its crash recovery)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while True:
            try:
                psycopg2.connect(self.admin_url, connect_timeout=2).close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise SystemExit("soak: the private PostgreSQL did not answer") from None
                time.sleep(0.1)

    def create_database(self, name: str) -> str:
        conn = psycopg2.connect(self.admin_url, connect_timeout=5)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url(name)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.home, ignore_errors=True)
