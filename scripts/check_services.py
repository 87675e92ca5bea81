"""Check that PostgreSQL and Redis answer before `make test` / `make run`; say what to start."""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlsplit

HINTS = {
    "PostgreSQL": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "Redis": (
        "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port {port} --save '' --appendonly no"
    ),
    "RabbitMQ": "rabbitmq-server -detached",
}


def answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), timeout=3
        ):
            return True
    except OSError:
        return False


def main() -> int:
    checks = [
        (
            "PostgreSQL",
            os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/x"),
            5432,
        ),
        ("Redis", os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), 6379),
    ]
    if os.environ.get("TEAMDESK_CHECK_RABBITMQ"):  # the test suite runs one worker on it
        checks.append(("RabbitMQ", "amqp://127.0.0.1:5672//", 5672))
    failed = False
    for name, url, port in checks:
        url = url.split(";", 1)[0]  # Redis under Sentinel: the first sentinel
        parts = urlsplit(url)
        port = parts.port or (26379 if parts.scheme == "sentinel" else port)
        where = f"{parts.hostname or '127.0.0.1'}:{port}"
        if answers(url, port):
            print(f"ok: {name} answers at {where}")
        else:
            failed = True
            print(
                f"MISSING: {name} does not answer at {where}. Start it, for example:\n"
                f"    {HINTS[name].format(port=port)}",
                file=sys.stderr,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
