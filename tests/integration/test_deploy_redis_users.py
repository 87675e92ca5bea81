"""deploy/compose.yaml's Redis loads the users of deploy/redis/users.acl: its start script,
run here with the local ``redis-server`` (the file's own shell, Compose's ``$$`` undone,
the container's paths pointed at the repository's file and a temporary directory),
reads each password from its secret file (none from the environment), and starts a
server on which each service's user logs in with its own password and only with it, gets
only its rules, and the administrator ``default`` needs the admin password. The script
refuses to start Redis with another QUEUE_PREFIX, a password file that is empty, or data
written by another user (a volume from the versions that ran Redis as root)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import yaml

from harness.waiting import wait_for
from teamdesk.redis_acl import ADMIN, COMPONENTS, PASSWORD_VARS, user_name
from tests.support.deploy_files import COMPOSE_FILE, DEPLOY
from tests.support.redis_server import free_port

CONTAINER_FILE = "/etc/teamdesk/users.acl"
CONTAINER_OUTPUT = "/tmp/users.acl"
CONTAINER_SECRETS = "/run/secrets/"
CONTAINER_DATA = "/data"


def start_script(port: int, workdir: Path) -> str:
    """The redis service's ``sh -c`` script as the container runs it, on this host."""
    service = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["redis"]
    written = str(service["command"][2])
    assert "$" not in written.replace("$$", ""), "a single $ would be Compose's interpolation"
    script = written.replace("$$", "$")
    for path in (CONTAINER_FILE, CONTAINER_OUTPUT, CONTAINER_SECRETS, CONTAINER_DATA):
        assert path in script, path
    script = script.replace(CONTAINER_FILE, str(DEPLOY / "redis" / "users.acl"))
    script = script.replace(CONTAINER_OUTPUT, str(workdir / "users.acl"))
    script = script.replace(CONTAINER_SECRETS, f"{workdir}/secrets/")
    script = script.replace(f"{CONTAINER_DATA} ", f"{workdir}/data ")
    local = f"redis-server --port {port} --bind 127.0.0.1 --dir {workdir} --appendonly no"
    assert "exec redis-server --appendonly yes" in script
    return script.replace("exec redis-server --appendonly yes", f"exec {local}")


@contextmanager
def compose_redis(
    prefix: str, passwords: dict[str, str], workdir: Path
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    (workdir / "data").mkdir(exist_ok=True)
    (workdir / "secrets").mkdir()
    for role, password in passwords.items():  # as deploy/compose.md writes them: a newline
        (workdir / "secrets" / PASSWORD_VARS[role].lower()).write_text(password + "\n")
    env = {"PATH": os.environ["PATH"], "QUEUE_PREFIX": prefix}
    process = subprocess.Popen(
        ["sh", "-c", start_script(port, workdir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process, port
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.communicate(timeout=10)


def logs_in(port: int, user: str, password: str) -> str | None:
    """Who the server says the connection is (``CLIENT INFO``) after logging in as
    ``user``, or None when the login is refused."""
    client = redis.Redis(port=port, username=user, password=password, socket_timeout=2)
    try:
        return str(client.client_info()["user"])
    except redis.AuthenticationError:
        return None
    finally:
        client.close()


def answers(port: int, password: str) -> bool:
    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


def test_composes_redis_loads_one_user_per_service(tmp_path: Path) -> None:
    passwords = {role: uuid.uuid4().hex for role in (ADMIN, *COMPONENTS)}
    with compose_redis("teamdesk", passwords, tmp_path) as (process, port):
        wait_for(lambda: answers(port, passwords[ADMIN]) or process.poll() is not None)
        assert process.poll() is None, process.communicate()
        names = {role: user_name(role, "teamdesk") for role in (ADMIN, *COMPONENTS)}
        own = {role: logs_in(port, names[role], passwords[role]) for role in names}
        other = logs_in(port, names["worker"], passwords["api"])
        api = redis.Redis(port=port, username=names["api"], password=passwords["api"])
        with pytest.raises(redis.exceptions.NoPermissionError):
            api.lpush("teamdesk:exports", "message")
        written = (tmp_path / "users.acl").read_text()
    assert own == names and other is None
    assert "sha256(" not in written and not any(p in written for p in passwords.values())


def test_composes_redis_does_not_start_with_a_file_for_another_prefix(tmp_path: Path) -> None:
    passwords = {role: uuid.uuid4().hex for role in (ADMIN, *COMPONENTS)}
    with compose_redis("other", passwords, tmp_path) as (process, _):
        code = process.wait(timeout=10)
        err = process.stderr.read() if process.stderr else ""
    assert code == 1
    assert err == "redis/users.acl is not for QUEUE_PREFIX=other: regenerate it\n"


def refusal(tmp_path: Path, passwords: dict[str, str]) -> tuple[int, str]:
    with compose_redis("teamdesk", passwords, tmp_path) as (process, _):
        code = process.wait(timeout=10)
        err = process.stderr.read() if process.stderr else ""
    return code, err


def test_composes_redis_does_not_start_with_an_empty_password(tmp_path: Path) -> None:
    passwords = {role: uuid.uuid4().hex for role in (ADMIN, *COMPONENTS)}
    code, err = refusal(tmp_path, {**passwords, "worker": ""})
    assert code == 1
    assert err == (
        "redis/secrets/redis_worker_password is missing or empty "
        '(deploy/compose.md, "Docker Compose (one host)")\n'
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user: needs root")
def test_composes_redis_does_not_start_on_data_of_another_user(tmp_path: Path) -> None:
    """Before this version Redis ran as root and its append-only files are root's: Redis,
    now its image's user, could not write them. The script says how to hand them over."""
    (tmp_path / "data" / "appendonlydir").mkdir(parents=True)
    os.chown(tmp_path / "data" / "appendonlydir", 12345, 12345)
    code, err = refusal(tmp_path, {role: uuid.uuid4().hex for role in (ADMIN, *COMPONENTS)})
    assert code == 1
    assert "holds files of another user" in err
    assert "--entrypoint chown redis -R redis:redis /data" in err
