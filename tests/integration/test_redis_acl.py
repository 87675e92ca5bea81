"""One Redis user per role (teamdesk/redis_acl.py; deploy/security.md, "Redis users"), loaded
into a dedicated ``redis-server`` from the ACL file ``teamdesk-tasks redis-acl`` prints.

- The API works as its user: task creation, both rate limits (429 from Redis's counts,
  not the limiter failing open), ``/api/workers/health`` reading a worker's heartbeat and
  the dispatcher's lock, which the worker and beat users wrote; Redis refused nothing.
- The API user may not touch the broker (a task queue, Celery's event and control
  channels, kombu's keys), the heartbeats, the lock, or run server-wide
  commands; beat, the worker and Flower are refused what is not theirs; no user may
  SELECT another database, nor run a script command its code does not run.
- A cluster on database 3: every role's client selects it as it connects, and may select
  no other.
- The dispatcher's reads run as beat: the lease holders with the record's epoch (INFO
  in a read-only script), the slots per queue, the broker's view of a queue.
- ``--format setuser`` loads the same users as the ACL file.

The worker, beat and Flower processes themselves run as their users in
tests/process/test_redis_acl_cluster.py.
"""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Iterator, Sequence

import pytest
import redis
import sqlalchemy as sa

from dispatcher.leader import Leadership, leader_key
from harness.factories import World
from ledger import service
from tasks.broker_view import look
from tasks.celery_app import create_app
from tasks.names import EXPORTS_QUEUE, TASK_QUEUES
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat, WorkerSlots, read_lease_holders, slots_by_queue
from teamdesk.redis_acl import ADMIN, COMPONENTS
from tests.support.api_helpers import BAD_TOKEN, api_client, bearer, exports_url, make_tokens
from tests.support.queues import send_message
from tests.support.redis_server import dedicated_redis
from tests.support.redis_users import AclRedis, redis_acl, redis_with_users

TTL_S = 5.0


@pytest.fixture
def acl_redis() -> Iterator[AclRedis]:
    with redis_with_users(f"tdt-{uuid.uuid4().hex[:8]}") as server:
        yield server


def test_the_api_works_as_its_redis_user(
    engine: sa.Engine, world: World, settings: Settings, acl_redis: AclRedis
) -> None:
    prefix = acl_redis.prefix
    worker = Heartbeat(
        acl_redis.client("worker"), prefix, "w1", TTL_S, WorkerSlots(tuple(TASK_QUEUES), 2)
    )
    leader = Leadership(acl_redis.client("beat"), leader_key(prefix), 15)
    assert worker.renew() and leader.ensure()
    api = settings.with_overrides(
        redis_url=acl_redis.url("api"),
        broker_url=acl_redis.url("api"),
        queue_prefix=prefix,
        api_rate_per_min=60,
        api_rate_burst=2,
        auth_failures_per_min=2,
    )
    staff = bearer(make_tokens(engine, world)["staff"])
    body = {"scope": "TEAM", "filters": {}}
    with api_client(api) as client:
        workers = client.get("/api/workers/health")
        created = [client.post(exports_url(world.team_id), json=body, headers=staff) for _ in "abc"]
        refused = [client.get("/api/teams/x/tasks", headers=bearer(BAD_TOKEN)) for _ in "abc"]
        listed = client.get(f"/api/teams/{world.team_id}/tasks", headers=staff)
    assert (workers.status_code, workers.json()) == (
        200,
        {
            "workers": True,
            "dispatcher": True,
            "consumers": {"exports": 2, "reminders": 2},
            "missing": [],
            "problems": [],
        },
    )
    assert [r.status_code for r in created] == [201, 201, 429]
    assert [r.status_code for r in refused] == [401, 401, 429]
    assert listed.status_code == 200 and len(listed.json()["tasks"]) == 2
    buckets = set(acl_redis.admin().scan_iter(match=f"{prefix}:ratelimit:*"))
    assert {key.split(":")[2] for key in buckets} == {"token", "auth", "read"}
    assert acl_redis.denials() == []


# (role, command): what each user is refused. P is the prefix; the database is 0.
REFUSED = [
    ("api", "LPUSH P:exports message"),
    ("api", "LPUSH P:reminders message"),
    ("api", "BRPOP P:exports 0.01"),
    ("api", "LLEN P:exports"),
    ("api", "PUBLISH P:/0.P.celeryev/task.succeeded event"),
    ("api", "PUBLISH P:/0.P.control.pidbox command"),
    ("api", "PSUBSCRIBE P:/0.P.celeryev/*"),
    ("api", "HSET P:unacked tag message"),
    ("api", "SADD P:_kombu.binding.exports member"),
    ("api", "SET P:queued:x-0 stamp"),
    ("api", "ZADD P:worker-heartbeat:active 1 member"),
    ("api", "SET P:worker-heartbeat:info:member {}"),
    ("api", "SET P:dispatcher:leader token"),
    ("api", "DEL P:dispatcher:leader"),
    ("api", "EVAL return 1 0"),
    ("api", "SCRIPT EXISTS 0"),
    ("api", "SELECT 1"),
    ("api", "FLUSHALL"),
    ("api", "KEYS *"),
    ("api", "SCAN 0"),
    ("api", "CONFIG GET *"),
    ("api", "SET other:key value"),
    ("beat", "PUBLISH P:/0.P.control.pidbox command"),
    ("beat", "PUBLISH P:/0.P.celeryev/task.succeeded event"),
    ("beat", "ZADD P:worker-heartbeat:holders 1 member"),
    ("beat", "SET P:ratelimit:token:x 1"),
    ("beat", "HSET P:unacked tag message"),
    ("beat", "FLUSHDB"),
    ("beat", "SELECT 1"),
    ("beat", "SCRIPT FLUSH"),
    ("worker", "SET P:dispatcher:leader token"),
    ("worker", "SET P:ratelimit:token:x 1"),
    ("worker", "PUBLISH other-channel message"),
    ("worker", "CONFIG SET maxmemory 1"),
    ("worker", "SELECT 1"),
    ("worker", "FUNCTION LOAD x"),
    ("flower", "LPUSH P:exports message"),
    ("flower", "HDEL P:unacked tag"),
    ("flower", "SET P:queued:x-0 stamp"),
    ("flower", "SET P:dispatcher:leader token"),
    ("flower", "ZADD P:worker-heartbeat:active 1 member"),
    ("flower", "PUBLISH P:celery-task-meta-x result"),
    ("flower", "SELECT 1"),
    ("flower", "EVAL return 1 0"),
    ("flower", "EVALSHA_RO 0 0"),
]


@pytest.mark.parametrize(("role", "command"), REFUSED, ids=[f"{r}: {c}" for r, c in REFUSED])
def test_each_user_is_refused_what_is_not_its_own(
    acl_redis: AclRedis, role: str, command: str
) -> None:
    args = re.sub(r"\bP(?=[:.])", acl_redis.prefix, command).split()
    client = acl_redis.client(role)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command(*args)
    assert acl_redis.denials()[0]["username"] == f"{acl_redis.prefix}-{role}"


def test_a_script_runs_only_what_its_caller_may_run(acl_redis: AclRedis) -> None:
    """The API user may run scripts (its rate limits) but a script of its own still cannot
    push to a queue: Redis checks each command a script runs."""
    client = acl_redis.client("api")
    push = client.register_script("return redis.call('LPUSH', KEYS[1], 'message')")
    with pytest.raises(redis.exceptions.NoPermissionError):
        push(keys=[f"{acl_redis.prefix}:exports"])
    sneak = client.register_script(f"return redis.call('LPUSH', '{acl_redis.prefix}:exports', 'm')")
    with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
        sneak(keys=[])
    assert acl_redis.admin().llen(f"{acl_redis.prefix}:exports") == 0


def test_the_dispatcher_reads_heartbeats_and_the_broker_as_beat(
    engine: sa.Engine, world: World, settings: Settings, acl_redis: AclRedis
) -> None:
    prefix = acl_redis.prefix
    worker = Heartbeat(
        acl_redis.client("worker"), prefix, "w1", TTL_S, WorkerSlots((EXPORTS_QUEUE,), 3)
    )
    assert worker.renew()
    urls = {"redis_url": acl_redis.url("beat"), "broker_url": acl_redis.url("beat")}
    app = create_app(settings.with_overrides(queue_prefix=prefix, **urls))
    try:
        with engine.begin() as conn:
            task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        send_message(app, task_id, 0)  # published as the dispatcher publishes
        beat = acl_redis.client("beat")
        holders = read_lease_holders(beat, prefix)
        slots = slots_by_queue(beat, prefix)
        views = look(app, beat, prefix, TASK_QUEUES)
    finally:
        app.close()
    assert holders.members == {worker.member} and holders.record_age_s is not None
    assert slots == {EXPORTS_QUEUE: 3}
    exports = views[EXPORTS_QUEUE]
    assert exports is not None and exports.ready == 1 and exports.listed is not None
    assert [message for message, _ in exports.listed] == [f"{task_id}-0"]
    assert acl_redis.denials() == []


def test_a_cluster_on_another_database_selects_it_and_no_other() -> None:
    with redis_with_users(f"tdt-{uuid.uuid4().hex[:8]}", db=3) as acl_redis:
        clients = {role: acl_redis.client(role) for role in COMPONENTS}
        connected = {role: client.ping() for role, client in clients.items()}  # SELECT 3 first
        for client in clients.values():
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command("SELECT", "0")
        denials = [(e["username"], e["object"]) for e in acl_redis.denials()]
    assert connected == {role: True for role in COMPONENTS}
    assert sorted(denials) == sorted(
        (f"{acl_redis.prefix}-{role}", "select") for role in COMPONENTS
    )


def users(acl_list: Sequence[str]) -> dict[str, set[str]]:
    """``ACL LIST`` as each user's set of rules (their order depends on how the rules were
    loaded), the administrator left out."""
    found = {}
    for entry in acl_list:
        _, name, *rules = entry.split()
        if name != ADMIN:
            found[name] = set(rules)
    return found


def test_the_setuser_commands_load_the_same_users_as_the_acl_file(acl_redis: AclRedis) -> None:
    commands = redis_acl(acl_redis.prefix, acl_redis.passwords, "--format", "setuser")
    assert [line.split()[2] for line in commands.splitlines()] == [
        f"{acl_redis.prefix}-{role}" for role in COMPONENTS
    ]
    with dedicated_redis() as fresh:
        client = fresh.client()
        for line in commands.splitlines():
            assert client.execute_command(*shlex.split(line)) == "OK"
        loaded = users([str(entry) for entry in client.acl_list()])
    assert loaded == users(acl_redis.acl_list()) and len(loaded) == len(COMPONENTS)
    for line in commands.splitlines():  # passwords only as their hashes
        assert not any(password in line for password in acl_redis.passwords.values())
