"""The Redis users' rules (teamdesk/redis_acl.py) and ``teamdesk-tasks redis-acl``:

- deploy/redis/users.acl is the command's output for the default prefix, placeholders
  for the passwords;
- the rules name the keys and channels the code uses (rate limits, the leader lock, the
  heartbeats, kombu's keys, Celery's exchanges), each for the roles that
  use it, read-only where a role only reads;
- no role may SELECT another database than the cluster's (none at all on database 0), and
  each may run only the script commands its code runs (the table below);
- a prefix that would smuggle a glob or a space into a rule is refused;
- the command prints passwords only as their SHA-256, and refuses to print a user whose
  password variable is unset.

That the rules are enough, and refuse the rest, is shown on a real Redis:
tests/integration/test_redis_acl.py and tests/process/test_redis_acl_cluster.py.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterator

import pytest
from kombu.transport.redis import Channel

from api.limits import RateLimiter, Rule
from cli.main import main
from dispatcher.leader import leader_key
from tasks.broker_view import UNACKED_KEY
from tasks.celery_app import celery_config
from tasks.names import TASK_QUEUES
from teamdesk import config, logs
from teamdesk.config import Settings
from teamdesk.heartbeat import active_key, holders_key, info_key, tombstone_key
from teamdesk.redis_acl import (
    ADMIN,
    COMPONENTS,
    PASSWORD_VARS,
    Layout,
    acl_file,
    component_rules,
    password_hash,
    placeholder,
)
from tests.support.deploy_files import DEPLOY

PREFIX = "teamdesk"
LAYOUT = Layout(PREFIX, tuple(TASK_QUEUES))


def test_the_shipped_acl_file_is_the_generators_output_for_the_default_prefix() -> None:
    expected = acl_file(LAYOUT, {role: placeholder(role) for role in (ADMIN, *COMPONENTS)})
    assert (DEPLOY / "redis" / "users.acl").read_text() == expected


def access(role: str, key: str) -> str:
    """What ``role`` may do to ``key``: "rw", "r", "w" or ""."""
    found: set[str] = set()
    for rule in component_rules(role, LAYOUT):
        for lead, grants in (("~", "rw"), ("%R~", "r"), ("%W~", "w"), ("%RW~", "rw")):
            if rule.startswith(lead) and fnmatch.fnmatchcase(key, rule[len(lead) :]):
                found.update(grants)
    return "".join(grant for grant in "rw" if grant in found)


def channels(role: str) -> list[str]:
    return [rule[1:] for rule in component_rules(role, LAYOUT) if rule.startswith("&")]


def test_the_rules_name_the_keys_the_code_uses_for_the_roles_that_use_them() -> None:
    queue = f"{PREFIX}:{TASK_QUEUES[0]}"
    member = "host/1f0c"
    reply = f"{PREFIX}:1f0c.reply.{PREFIX}.control.pidbox"
    keys = {
        "rate limit": RateLimiter(lambda: None, PREFIX).key(Rule("token", 1, 1), "t"),  # type: ignore[arg-type, return-value]
        "leader": leader_key(PREFIX),
        "active": active_key(PREFIX),
        "scope": active_key(PREFIX, "host"),
        "holders": holders_key(PREFIX),
        "info": info_key(PREFIX, member),
        "tombstone": tombstone_key(PREFIX, member),
        "queue": queue,
        "queue, priority 3": f"{queue}{Channel.sep}3",
        "unacked": f"{PREFIX}:{UNACKED_KEY}",
        "unacked index": f"{PREFIX}:{Channel.unacked_index_key}",
        "unacked mutex": f"{PREFIX}:{Channel.unacked_mutex_key}",
        "binding": f"{PREFIX}:{Channel.keyprefix_queue % TASK_QUEUES[0]}",
        "reply queue": reply,
        "result": f"{PREFIX}:celery-task-meta-1f0c-0",
    }
    table = {name: tuple(access(role, key) for role in COMPONENTS) for name, key in keys.items()}
    #                      api    worker  beat  flower
    assert table == {
        "rate limit": ("rw", "", "", ""),
        "leader": ("r", "", "rw", ""),
        "active": ("r", "rw", "r", ""),
        "scope": ("", "rw", "r", ""),
        "holders": ("", "rw", "r", ""),
        "info": ("r", "rw", "r", ""),
        "tombstone": ("", "rw", "r", ""),
        "queue": ("", "rw", "rw", "r"),
        "queue, priority 3": ("", "rw", "rw", "r"),
        "unacked": ("", "rw", "r", "r"),
        "unacked index": ("", "rw", "", "r"),
        "unacked mutex": ("", "rw", "", "rw"),
        "binding": ("", "rw", "rw", ""),
        "reply queue": ("", "rw", "", "rw"),
        "result": ("", "rw", "", ""),
    }


def test_the_channels_are_celerys_exchanges_on_the_brokers_database() -> None:
    config = celery_config(Settings(queue_prefix=PREFIX))
    events = f"{PREFIX}:/0.{config['event_exchange']}"
    pidbox = f"{PREFIX}:/0.{config['control_exchange']}.pidbox"
    assert channels("api") == [] and channels("beat") == []
    assert channels("worker") == [
        f"{events}/*",
        f"{events}/worker.*",  # gossip subscribes to this pattern, literally
        pidbox,
        f"{PREFIX}:celery-task-meta-*",
    ]
    assert channels("flower") == [f"{events}/*", pidbox]
    assert f"{PREFIX}:/3.{PREFIX}.control.pidbox" in [
        rule[1:] for rule in component_rules("worker", Layout(PREFIX, LAYOUT.queues, 3))
    ]


def selects(role: str, layout: Layout) -> list[str]:
    return [rule for rule in component_rules(role, layout) if "select" in rule]


def test_no_role_may_select_another_database() -> None:
    """ACL key patterns hold in every database: SELECT would reach another database's keys
    of the same prefix. A client on database 0 sends no SELECT; on 3 it may select 3 only."""
    on_three = Layout(PREFIX, LAYOUT.queues, 3)
    assert {role: selects(role, LAYOUT) for role in COMPONENTS} == {
        role: ["-select"] for role in COMPONENTS
    }
    assert {role: selects(role, on_three) for role in COMPONENTS} == {
        role: ["-select", "+select|3"] for role in COMPONENTS
    }


def scripting(role: str) -> list[str]:
    found = [
        r for r in component_rules(role, LAYOUT) if r.startswith(("+eval", "+script", "+fcall"))
    ]
    return [rule[1:] for rule in found]


def test_each_role_may_run_only_the_script_commands_its_code_runs() -> None:
    """EVALSHA (with SCRIPT LOAD, redis-py's answer to NOSCRIPT) runs any script, as EVAL
    does: Redis 7 cannot allow a script by its SHA. So the list is no allow-list of scripts,
    only of the commands each role's scripts need (teamdesk/redis_acl.py, SCRIPTS)."""
    assert {role: scripting(role) for role in COMPONENTS} == {
        "api": ["evalsha", "evalsha_ro", "script|load"],
        "worker": ["evalsha", "evalsha_ro", "script|load", "script|exists"],
        "beat": ["evalsha", "evalsha_ro", "script|load"],
        "flower": ["evalsha", "script|load", "script|exists"],
    }


@pytest.mark.parametrize("prefix", ["team desk", "team*", "a?b", "[ab]", "", "-x", "a\\b"])
def test_a_prefix_that_is_not_plain_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="QUEUE_PREFIX must be letters"):
        Layout(prefix, LAYOUT.queues)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterator[object]:
    def run(*args: str) -> tuple[int, str, str]:
        config.set_settings(None)  # read from the environment the test set
        code = main(["redis-acl", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    yield run
    config.set_settings(None)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logs._JsonHandler):
            root.removeHandler(handler)


def test_the_command_prints_hashes_never_passwords(
    run_cli: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwords = {role: f"pw-{role}-0123456789" for role in (ADMIN, *COMPONENTS)}
    for role, password in passwords.items():
        monkeypatch.setenv(PASSWORD_VARS[role], password)
    monkeypatch.setenv("QUEUE_PREFIX", "cluster-b")
    code, out, err = run_cli()  # type: ignore[operator]
    setuser = run_cli("--role", "api", "--format", "setuser")  # type: ignore[operator]
    hashes = {role: password_hash(password) for role, password in passwords.items()}
    assert (code, err) == (0, "")
    assert out == acl_file(Layout("cluster-b", LAYOUT.queues), hashes)
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["user", "default"],
        *(["user", f"cluster-b-{role}"] for role in COMPONENTS),
    ]
    assert not any(password in out + setuser[1] for password in passwords.values())
    assert setuser[0] == 0 and setuser[1].startswith(
        f"ACL SETUSER cluster-b-api reset on #{hashes['api']} "
    )
    assert len(setuser[1].splitlines()) == 1


def test_the_command_refuses_a_missing_password_and_a_bad_prefix(
    run_cli: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in PASSWORD_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("REDIS_API_PASSWORD", "pw")
    missing = run_cli("--role", "api", "--role", "worker")  # type: ignore[operator]
    monkeypatch.setenv("QUEUE_PREFIX", "team*")
    bad_prefix = run_cli("--role", "api")  # type: ignore[operator]
    assert missing == (
        2,
        "",
        "teamdesk-tasks redis-acl: set REDIS_WORKER_PASSWORD (the worker user's password), "
        "or print placeholders with --placeholders\n",
    )
    assert bad_prefix == (
        2,
        "",
        "teamdesk-tasks redis-acl: QUEUE_PREFIX must be letters, digits, '_', '.' or '-' to "
        "write Redis ACL rules\n",
    )
