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


def addresses(url: str, default_port: int) -> list[tuple[str, int]]:
    """Every host:port a URL names: libpq's host list (`a:5432,b:5432`) and Sentinel's
    `sentinel://a;sentinel://b` form name several."""
    found = []
    for one in url.split(";"):
        parts = urlsplit(one)
        if parts.scheme == "sentinel":
            default_port = 26379
        for host in parts.netloc.rpartition("@")[2].split(","):
            found.append(host_and_port(host, default_port))
    return found


def host_and_port(host: str, default_port: int) -> tuple[str, int]:
    """`a:5432`, `a`, `[::1]:5432`, `[::1]` or empty (the default host)."""
    name, colon, port = host.rpartition(":")
    if not colon or name.endswith(":") or "]" in port or (name.count(":") and "]" not in name):
        name, port = host, ""
    return name.strip("[]") or "127.0.0.1", int(port) if port else default_port


def answers(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=3):
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
    for name, url, default_port in checks:
        found = addresses(url, default_port)
        answering = [address for address in found if answers(address)]
        where = ", ".join(f"{host}:{port}" for host, port in found)
        if answering:
            host, port = answering[0]
            print(f"ok: {name} answers at {host}:{port}")
        else:
            port = found[0][1]
            failed = True
            print(
                f"MISSING: {name} does not answer at {where}. Start it, for example:\n"
                f"    {HINTS[name].format(port=port)}",
                file=sys.stderr,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
