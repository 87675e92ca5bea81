"""A rolling upgrade from the previous release, and the rollback of its code, under load
(docs/decisions.md, "Expand and contract: the previous release keeps working";
deploy/operations.md, "Upgrading").

The previous release (harness/previous_release.txt) runs from its own checkout and
virtualenv (harness/releases.py). **Upgrade**: its own ``migrate`` makes the database,
its beat and two workers run; head's ``migrate`` runs beside them; then head's workers,
then head's beat, replace them one at a time, each old process stopped with SIGTERM once
its replacement is up. **Rollback**: the same with head's processes (on head's schema)
replaced by the previous release's. Tasks are created all along. Every task must complete
exactly once, with nothing taken back, and every process, of either release, must have
stayed up until its SIGTERM, exited 0 on it and logged no error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from harness import databases
from harness.factories import make_world
from harness.processes import ROOT, Proc, celery_argv, cluster, settings_env, worker_argv
from harness.releases import Release, ReleaseProc, ensure_installed, previous_release
from harness.waiting import wait_for
from teamdesk import config
from teamdesk.config import Settings
from teamdesk.db import make_engine
from tests.conftest import REDIS_URL
from tests.support import db_roles, rollout

pytestmark = pytest.mark.slow

WORKERS = (("w1", "exports"), ("w2", "reminders,exports"))  # as `make run` splits them
STOP_MARGIN_S = 15.0  # a SIGTERMed process exits within its drain budget and this


@pytest.fixture(scope="module")
def release() -> Release:
    old = previous_release()
    took = ensure_installed(old)
    print(f"{old.label}: " + ("cached" if took is None else f"installed in {took:.1f} s"))
    return old


@dataclass(frozen=True)
class Database:
    """An empty database (``owner_url``: its owner, who migrates) and the application
    role the cluster connects as (``app_url``), as the deployments run them."""

    owner_url: str
    role: str

    @property
    def app_url(self) -> str:
        parts = urlsplit(self.owner_url)
        return urlunsplit(parts._replace(netloc=f"{self.role}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def database(services: None) -> Iterator[Database]:
    name, url = databases.empty_database(f"tdt{os.getpid()}_upgrade")
    role = f"tdt_upgrade_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    yield Database(url, role)
    databases.drop_database(name)
    db_roles.drop_role(role)  # roles are cluster-wide; its grants went with the database


@dataclass
class Side:
    """One release's processes, built (not started) by ``make(name, argv)``."""

    label: str
    make: Callable[[str, list[str]], Proc]

    def beat(self) -> Proc:
        proc = self.make(f"{self.label}-beat", celery_argv("beat"))
        # Every scan logs dispatcher.scan, at debug when it had nothing of note: the test
        # waits for scans by their lines.
        proc.env = {**proc.env, "LOG_LEVEL": "debug"}
        return proc

    def worker(self, name: str, queues: str) -> Proc:
        # Its own node name, as a pod of its own has: w1 and its replacement overlap.
        node = f"{self.label}-{name}"
        return self.make(node, worker_argv(node, queues=queues))


def migrate(command: list[str], database: Database, cwd: Path) -> float:
    """``<command> migrate --app-role <role>`` as the owner (the deployments' migrate);
    its first run creates the role. Returns the seconds it took."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "APP_DB_PASSWORD")}
    env.update({"DATABASE_URL": database.owner_url, "LOG_LEVEL": "warn"})
    env["APP_DB_PASSWORD"] = uuid.uuid4().hex  # trust auth: only needed to create it
    argv = [*command, "migrate", "--app-role", database.role]
    started = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - started


def completed_by(proc: Proc) -> int:
    return len(proc.events("task.completed"))


def assert_up(procs: list[Proc]) -> None:
    for proc in procs:
        assert proc.popen is not None
        code = proc.popen.poll()
        said = [line for line in rollout.error_lines(proc) if line.startswith("{")]
        last = said[-1][:1500] if said else proc.output()[-3000:]
        assert code is None, f"{proc.name} exited ({code}) unasked:\n{last}"


def wait_done(procs: list[Proc], more: int, up: list[Proc]) -> None:
    """Wait until ``procs`` completed ``more`` tasks than now, ``up`` staying up."""
    target = sum(map(completed_by, procs)) + more

    def probe() -> bool:
        assert_up(up)
        return sum(map(completed_by, procs)) >= target

    wait_for(probe, timeout=60, interval=0.1, what=f"{more} more tasks completed")


def leads(beat: Proc) -> bool:
    return any(e.get("role") == "leader" for e in beat.events("dispatcher.leader"))


def stop(procs: list[Proc], timeout_s: float) -> None:
    """SIGTERM each of ``procs`` (up until then): each must exit 0 within its drain budget."""
    assert_up(procs)
    for proc in procs:
        proc.send(signal.SIGTERM)
    for proc in procs:
        code = proc.wait(timeout=timeout_s)
        assert code == 0, f"{proc.name} exited {code} on SIGTERM:\n{proc.output()[-3000:]}"


def replace(old: Proc, new: Proc, running: list[Proc], timeout_s: float) -> None:
    """Start ``new`` and wait until it is up, then SIGTERM ``old``: ``old`` (and all of
    ``running``) must have stayed up until then, and ``old`` must exit 0 within its drain
    budget. ``running`` ends with ``new`` in ``old``'s place."""
    new.start()
    running.append(new)
    # A beat stands by first (the old one holds the leader lock); a worker says started.
    new.wait_event("dispatcher.leader" if "beat" in new.name else "worker.started", timeout=60)
    assert_up(running)
    running.remove(old)
    stop([old], timeout_s)


def roll(
    before: Side,
    after: Side,
    load: rollout.Load,
    settings: Settings,
    tmp_path: Path,
    between: Callable[[Proc], None],
) -> list[Proc]:
    """Run ``before``'s beat and workers, call ``between`` (a migrate) while they work,
    then replace the workers and the beat with ``after``'s, one at a time; once every task
    has finished, stop ``after``'s too. Returns every process, each stopped by SIGTERM."""
    timeout_s = settings.shutdown_timeout_s + STOP_MARGIN_S
    with cluster(tmp_path) as procs:
        beat = before.beat()
        workers = [before.worker(name, queues) for name, queues in WORKERS]
        procs += [beat.start(), *(w.start() for w in workers)]
        running = list(procs)
        wait_for(lambda: leads(beat), timeout=60, what=f"{beat.name} to lead")
        for worker in workers:
            worker.wait_event("worker.started", timeout=60)
        try:
            load.start()
            wait_done(workers, 10, running)
            between(beat)
            wait_done(workers, 10, running)
            for old, (name, queues) in zip(workers, WORKERS, strict=True):
                new = after.worker(name, queues)
                procs.append(new)
                replace(old, new, running, timeout_s)
                wait_done([new], 3, running)
            new_beat = after.beat()
            procs.append(new_beat)
            replace(beat, new_beat, running, timeout_s)
            wait_for(lambda: leads(new_beat), timeout=60, what=f"{new_beat.name} to lead")
            wait_done(running, 10, running)
        finally:
            load.stop()
        assert load.errors == [], "a creation failed"
        ids = load.ids()
        wait_for(
            lambda: rollout.finished(load.engine, ids) == len(ids),
            timeout=90,
            interval=0.2,
            what="every task to finish",
        )
        stop(running, timeout_s)
    return procs


def sides(release: Release, settings: Settings, tmp_path: Path) -> tuple[Side, Side]:
    env = settings_env(settings)

    def old(name: str, argv: list[str]) -> Proc:
        return ReleaseProc(release, name, argv, env, tmp_path)

    def head(name: str, argv: list[str]) -> Proc:
        return Proc(name, argv, env, tmp_path)

    return Side(release.label, old), Side("head", head)


def cluster_settings(url: str, prefix: str) -> Settings:
    return config.load_settings(
        {
            "DATABASE_URL": url,
            "REDIS_URL": REDIS_URL,
            "QUEUE_PREFIX": prefix,
            "WORKER_INSTANCE_ID": f"upgrade-{uuid.uuid4().hex[:6]}",
        }
    )


@pytest.mark.parametrize("direction", ["upgrade", "rollback"])
def test_rolling_replacement_under_load(
    direction: str, release: Release, database: Database, queue_prefix: str, tmp_path: Path
) -> None:
    settings = cluster_settings(database.app_url, queue_prefix)
    old, head = sides(release, settings, tmp_path)
    head_migrate = [sys.executable, "-m", "cli.main"]
    started = time.monotonic()
    if direction == "upgrade":
        took = migrate([str(release.bin("teamdesk-tasks"))], database, release.src)
        print(f"{release.label} migrate: {took:.1f} s")
    else:
        migrate(head_migrate, database, ROOT)
    engine = make_engine(database.app_url)
    try:
        seeded = rollout.seed(engine, make_world(engine))
        creator = rollout.sql_creator if direction == "upgrade" else rollout.head_creator
        load = rollout.Load(engine, seeded, creator(seeded.world))

        def head_migrates_beside_them(beat: Proc) -> None:
            scans = len(beat.events("dispatcher.scan"))
            took = migrate(head_migrate, database, ROOT)
            print(f"head migrate beside {release.label}'s processes: {took:.1f} s")
            load.creator = rollout.head_creator(seeded.world)
            # Two scans after it (each reads the ledger's statistics): 0.9's beat died at
            # its first after 0008 had dropped the index it names.
            beat.wait_event("dispatcher.scan", timeout=60, count=scans + 2)

        before, after = (old, head) if direction == "upgrade" else (head, old)
        between = head_migrates_beside_them if direction == "upgrade" else (lambda _beat: None)
        procs = roll(before, after, load, settings, tmp_path, between)
        faults = rollout.ledger_faults(engine, load)
    finally:
        engine.dispose()
    print(f"{direction}: {len(load.created)} tasks in {time.monotonic() - started:.1f} s")
    assert faults == [], "\n".join(faults[:20])
    for proc in procs:
        assert rollout.error_lines(proc) == [], proc.name
