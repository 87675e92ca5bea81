"""scripts/check_services.py (the first step of make test and make run): a service that
does not answer is named with the address REDIS_URL / DATABASE_URL give, and the hint
starts it on that port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_services.py"


def test_a_missing_redis_is_named_with_the_port_redis_url_gives() -> None:
    closed = free_port()
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{closed}/0"}
    env.pop("TEAMDESK_CHECK_RABBITMQ", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"MISSING: Redis does not answer at 127.0.0.1:{closed}. Start it, for example:\n"
        f"    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port {closed} --save '' "
        "--appendonly no\n"
    )
