"""scripts/check_services.py (the first step of make test and make run): a service that
does not answer is named with the address REDIS_URL / DATABASE_URL give, and the hint
starts it on that port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from harness.processes import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_services.py"


def check(database_url: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    """The script with both URLs given: a unit test must not depend on what answers at the
    default ports (`test_test_tiers` runs the unit tier with no service reachable)."""
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
    env.pop("TEAMDESK_CHECK_RABBITMQ", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30
    )


def test_a_missing_redis_is_named_with_the_port_redis_url_gives() -> None:
    closed, closed_pg = free_port(), free_port()
    done = check(f"postgresql://u@127.0.0.1:{closed_pg}/x", f"redis://127.0.0.1:{closed}/0")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        f"MISSING: PostgreSQL does not answer at 127.0.0.1:{closed_pg}. Start it, for example:\n"
        "    pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n"
        f"MISSING: Redis does not answer at 127.0.0.1:{closed}. Start it, for example:\n"
        f"    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port {closed} --save '' "
        "--appendonly no\n"
    )


def test_a_host_list_answers_when_one_of_its_hosts_does() -> None:
    """libpq's host list (a primary and its standby) and a Sentinel list: one answering
    address is enough; before, a multi-host DATABASE_URL crashed the check (ValueError)."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        closed = free_port()
        done = check(
            f"postgresql://u:secret@127.0.0.1:{closed},127.0.0.1:{port}/x",
            f"sentinel://127.0.0.1:{closed};sentinel://127.0.0.1:{port}",
        )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == (
        f"ok: PostgreSQL answers at 127.0.0.1:{port}\nok: Redis answers at 127.0.0.1:{port}\n"
    )


def test_no_answer_from_a_host_list_names_every_address() -> None:
    first, second = free_port(), free_port()
    done = check(
        f"postgresql://u@127.0.0.1:{first},127.0.0.1:{second}/x",
        f"sentinel://127.0.0.1:{first};sentinel://127.0.0.1:{second}",
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == (
        f"MISSING: PostgreSQL does not answer at 127.0.0.1:{first}, 127.0.0.1:{second}. "
        "Start it, for example:"
    )
    assert done.stderr.splitlines()[2] == (
        f"MISSING: Redis does not answer at 127.0.0.1:{first}, 127.0.0.1:{second}. "
        "Start it, for example:"
    )
