"""A dedicated Redis whose users are the cluster's roles (teamdesk/redis_acl.py), loaded
from the ACL file ``teamdesk-tasks redis-acl`` prints, as an operator loads them: each
role's URL and client, and the server's ACL log (every command, key or channel it
refused, and to whom)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from teamdesk.redis_acl import ADMIN, COMPONENTS, PASSWORD_VARS, user_name
from tests.support.redis_server import RedisServer, dedicated_redis


def redis_acl(prefix: str, passwords: dict[str, str], *args: str) -> str:
    """What ``teamdesk-tasks redis-acl`` prints for this prefix and these passwords (by
    role), run as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if k not in PASSWORD_VARS.values()}
    env.update({"QUEUE_PREFIX": prefix, "LOG_LEVEL": "warn"})
    env.update({PASSWORD_VARS[role]: password for role, password in passwords.items()})
    argv = [sys.executable, "-m", "cli.main", "redis-acl", *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclass(frozen=True)
class AclRedis:
    server: RedisServer
    prefix: str
    passwords: dict[str, str]
    db: int = 0  # the cluster's database (``teamdesk-tasks redis-acl --db``)

    def url(self, role: str) -> str:
        name = user_name(role, self.prefix)
        return f"redis://{name}:{self.passwords[role]}@127.0.0.1:{self.server.port}/{self.db}"

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role), decode_responses=True, socket_timeout=2)

    def admin(self) -> redis.Redis:
        return self.server.client()

    def denials(self) -> list[dict[str, Any]]:
        """The ACL log: what was refused, newest first."""
        entries: list[dict[str, Any]] = self.admin().acl_log(count=1000)
        return entries

    def acl_list(self) -> list[str]:
        return sorted(str(entry) for entry in self.admin().acl_list())


@contextmanager
def redis_with_users(prefix: str, db: int = 0) -> Iterator[AclRedis]:
    """A dedicated Redis started with ``--aclfile``: the administrator and one user per
    role, random passwords, for a cluster on database ``db``."""
    passwords = {role: uuid.uuid4().hex for role in (ADMIN, *COMPONENTS)}
    with tempfile.TemporaryDirectory(prefix="tdt-acl-") as workdir:
        path = Path(workdir) / "users.acl"
        path.write_text(redis_acl(prefix, passwords, "--db", str(db)))
        with dedicated_redis("--aclfile", str(path), password=passwords[ADMIN]) as server:
            yield AclRedis(server, prefix, passwords, db)
