"""Configuration is validated once; a bad value names its variable and stops the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ledger.retention import Retention
from tasks.celery_app import celery_config
from teamdesk.config import ConfigError, Settings, load_settings
from teamdesk.db import sqlalchemy_url
from teamdesk.redis_client import SentinelTarget, sentinel_target


def test_defaults_match_the_spec() -> None:
    s = load_settings({})
    assert (
        s.max_task_attempts,
        s.retry_base_delay_s,
        s.stale_after_s,
        s.scan_interval_s,
        s.heartbeat_ttl_s,
        s.max_recoveries,
        s.export_max_rows,
        s.export_batch_size,
        s.shutdown_timeout_s,
    ) == (3, 2.0, 120.0, 3.0, 20.0, 2, 10_000, 500, 75.0)
    assert s.broker_url == s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.queue_prefix == "teamdesk" and s.log_level == "info"
    assert s.worker_instance_id


def test_values_are_read_and_broker_follows_redis() -> None:
    s = load_settings(
        {
            "REDIS_URL": "redis://cache:6380/2",
            "STALE_AFTER_S": "1.5",
            "LOG_LEVEL": "WARN",
            "MAX_TASK_ATTEMPTS": "5",
            "WORKER_INSTANCE_ID": "pod-7",
        }
    )
    assert s == Settings(
        redis_url="redis://cache:6380/2",
        broker_url="redis://cache:6380/2",
        stale_after_s=1.5,
        log_level="warn",
        max_task_attempts=5,
        worker_instance_id="pod-7",
    )
    assert load_settings(
        {"BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/teamdesk"}
    ).broker_url.startswith("amqp://")
    assert load_settings(
        {"BROKER_URL": "amqp://mq/staging-desk", "QUEUE_PREFIX": "staging-desk"}
    ).broker_url.endswith("/staging-desk")


@pytest.mark.parametrize(
    "url", ["amqp://guest:guest@127.0.0.1:5672//", "amqp://mq", "amqp://mq/other", "pyamqp://mq/"]
)
def test_rabbitmq_needs_the_clusters_own_virtual_host(url: str) -> None:
    """Queue names are not prefixed on RabbitMQ: two clusters sharing a virtual host
    would consume each other's messages, so the virtual host must be QUEUE_PREFIX."""
    with pytest.raises(ConfigError) as refused:
        load_settings({"BROKER_URL": url})
    assert str(refused.value) == (
        "BROKER_URL: on RabbitMQ each cluster needs its own virtual host, named like "
        "QUEUE_PREFIX: end the URL with /teamdesk"
    )


def test_a_database_url_may_list_a_primary_and_its_standbys() -> None:
    """libpq's host list with target_session_attrs (a failover pair) is accepted as given
    and handed to SQLAlchemy as one host parameter per host."""
    url = "postgresql://app:s3cret@db-a:5432,db-b:5433/teamdesk?target_session_attrs=read-write"
    assert load_settings({"DATABASE_URL": url}).database_url == url
    assert sqlalchemy_url(url) == (
        "postgresql+psycopg2://app:s3cret@/teamdesk?host=db-a:5432&host=db-b:5433"
        "&target_session_attrs=read-write"
    )
    assert sqlalchemy_url("postgresql://u@h/db") == "postgresql+psycopg2://u@h/db"


def test_redis_under_sentinel_needs_the_masters_name() -> None:
    url = "sentinel://:pw@s1:26379/2;sentinel://s2:26380;sentinel://s3"
    s = load_settings(
        {"REDIS_URL": url, "REDIS_SENTINEL_MASTER": "desk", "REDIS_SENTINEL_PASSWORD": "x"}
    )
    assert (s.redis_url, s.broker_url, s.redis_sentinel_master) == (url, url, "desk")
    assert sentinel_target(url) == SentinelTarget(
        sentinels=[("s1", 26379), ("s2", 26380), ("s3", 26379)], db=2, username=None, password="pw"
    )
    options = celery_config(s)
    expected = {
        "master_name": "desk",
        "sentinel_kwargs": {"socket_timeout": 2.0, "socket_connect_timeout": 2.0, "password": "x"},
    }
    assert options["broker_transport_options"] == {
        "global_keyprefix": "teamdesk:",
        "visibility_timeout": 3600,
        **expected,
    }
    assert options["result_backend_transport_options"] == {
        "global_keyprefix": "teamdesk:",
        **expected,
    }
    with pytest.raises(ConfigError) as missing:
        load_settings({"BROKER_URL": url})
    assert str(missing.value) == (
        "REDIS_SENTINEL_MASTER must name the master the sentinels monitor "
        "(REDIS_URL or BROKER_URL lists sentinels)"
    )
    with pytest.raises(ConfigError) as stray:
        load_settings({"REDIS_SENTINEL_MASTER": "desk"})
    assert "apply only when REDIS_URL or BROKER_URL lists sentinels" in str(stray.value)
    with pytest.raises(ConfigError) as mixed:
        load_settings(
            {"REDIS_URL": "sentinel://s1:26379;redis://r:6379", "REDIS_SENTINEL_MASTER": "m"}
        )
    assert str(mixed.value) == (
        "REDIS_URL: list every sentinel as sentinel://host:port, separated by ';'"
    )


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MAX_TASK_ATTEMPTS": "three"}, "MAX_TASK_ATTEMPTS must be a whole number"),
        ({"MAX_TASK_ATTEMPTS": "0"}, "MAX_TASK_ATTEMPTS must be at least 1"),
        ({"STALE_AFTER_S": "-5"}, "STALE_AFTER_S must be from 1 to 86400 seconds"),
        ({"HEARTBEAT_TTL_S": "nan"}, "HEARTBEAT_TTL_S must be a number"),
        ({"EXPORT_BATCH_SIZE": "2.5"}, "EXPORT_BATCH_SIZE must be a whole number"),
        ({"SHUTDOWN_TIMEOUT_S": "-1"}, "SHUTDOWN_TIMEOUT_S must be from 0 to 3600 seconds"),
        (
            {"LOG_LEVEL": "loud"},
            "LOG_LEVEL must be one of fatal|error|warn|info|debug|trace|silent",
        ),
        ({"DATABASE_URL": "mysql://u@h/db"}, "DATABASE_URL must start with one of"),
        ({"DATABASE_URL": "postgresql://u@h:notaport/db"}, "DATABASE_URL is not a valid URL"),
        ({"DATABASE_URL": "postgresql://u@h:1,h2:x/db"}, "DATABASE_URL is not a valid URL"),
        ({"DATABASE_URL": "postgresql://u@h:1,/db"}, "DATABASE_URL must name a host"),
        ({"REDIS_URL": "sentinel://s:bad"}, "REDIS_URL is not a valid URL"),
        ({"EXPORT_READ_BUDGET_S": "0"}, "EXPORT_READ_BUDGET_S must be from 1 to 3600 seconds"),
        ({"REDIS_URL": "redis://"}, "REDIS_URL must name a host"),
        ({"BROKER_URL": "kafka://h"}, "BROKER_URL must start with one of"),
        ({"QUEUE_PREFIX": "a b"}, "QUEUE_PREFIX must not contain spaces"),
        ({"DATABASE_PREPARED_STATEMENTS": "sometimes"}, "DATABASE_PREPARED_STATEMENTS must be on"),
        ({"TASK_RETENTION_DAYS": "0.5"}, "TASK_RETENTION_DAYS must be from 1 to 3650 days"),
        ({"AUDIT_RETENTION_DAYS": "a month"}, "AUDIT_RETENTION_DAYS must be a number"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    assert needle in str(info.value)


def test_entry_point_refuses_bad_config_without_traceback() -> None:
    env = {**os.environ, "DATABASE_URL": "postgresql://u:hunter2@h:bad/db"}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "teamdesk-tasks: configuration error: DATABASE_URL is not a valid URL"
    )
    assert "Traceback" not in proc.stderr and "hunter2" not in proc.stderr + proc.stdout


def test_a_mistyped_option_is_refused_by_its_command_with_the_closest_match() -> None:
    """``health --clsuter``: the health command's usage and "did you mean --cluster?".
    Before: the top-level usage, which lists no option of any command."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "health", "--clsuter"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "usage: teamdesk-tasks health [-h] [--scope S] [--cluster]\n"
        "teamdesk-tasks health: error: unrecognized arguments: --clsuter "
        "(did you mean --cluster?)\n"
    )


def test_every_command_has_help() -> None:
    from cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:  # type: ignore[union-attr]
        proc = subprocess.run(
            [sys.executable, "-m", "cli.main", name, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and "usage: teamdesk-tasks" in proc.stdout, name


def test_health_probe_refuses_bad_config_like_every_command() -> None:
    """A configuration error is exit 2 and one line, for the probe as for every command
    (a container runtime counts any non-zero exit as a failed check)."""
    env = {**os.environ, "HEARTBEAT_TTL_S": "abc"}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "health"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "teamdesk-tasks: configuration error: HEARTBEAT_TTL_S must be a number, got 'abc'\n"
    )


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, True), ("on", True), ("off", False), ("FALSE", False), ("1", True)]
)
def test_prepared_statements_switch(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"DATABASE_PREPARED_STATEMENTS": raw}
    assert load_settings(env).database_prepared_statements is expected


def test_retention_defaults_and_overrides_reach_the_purge() -> None:
    assert Retention.of(load_settings({})) == Retention(task_days=30.0, audit_days=30.0)
    settings = load_settings({"TASK_RETENTION_DAYS": "7", "AUDIT_RETENTION_DAYS": "400"})
    assert Retention.of(settings) == Retention(task_days=7.0, audit_days=400.0)
