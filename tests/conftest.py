"""Shared fixtures: real PostgreSQL and Redis, a database per test, a Redis prefix per test."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from harness import databases
from harness.factories import World, make_world
from teamdesk import config, db
from teamdesk.config import Settings

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RUN_ID = f"tdt{os.getpid()}_{uuid.uuid4().hex[:6]}"


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2
        ):
            return True
    except OSError:
        return False


# The longest tests, started first so that a parallel run (pytest-xdist, ``make test``)
# does not end waiting for one of them alone: module names, longest first.
LONGEST_FIRST = (
    "test_soak_short",
    "test_upgrade",
    "test_autoscaling_backlog",
    "test_dispatch_loop",  # the longest integration tests: first in ``make check`` too
    "test_api_fuzz",
)
# Then tier by tier: the process tests (long, mostly waiting on their subprocesses, TTLs
# and scans) before the short, CPU-bound integration and unit tests, which fill the
# processes' waits and the end of the run (``make test`` runs the tiers in one session).
TIERS_FIRST_TO_LAST = ("process", "integration", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the longest tests first, then the process tier (a stable sort: the rest keep
    their order)."""

    def rank(item: pytest.Item) -> tuple[int, int]:
        module, tier = item.path.stem, item.path.parent.name
        first = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
        order = TIERS_FIRST_TO_LAST
        return first, order.index(tier) if tier in order else len(order)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def services() -> None:
    """PostgreSQL and Redis answer; else the session stops with one line saying what to
    start. Only the tests that use them ask (tests/unit runs with neither)."""
    missing = []
    if not _answers(databases.ADMIN_URL, 5432):
        missing.append("PostgreSQL at 127.0.0.1:5432")
    if not _answers(REDIS_URL, 6379):
        missing.append("Redis at 127.0.0.1:6379")
    if missing:
        pytest.exit("tests need " + " and ".join(missing) + " (see README: Services)", returncode=3)


@pytest.fixture(scope="session")
def template_db(services: None) -> Iterator[str]:
    name = databases.create_template(RUN_ID)
    yield name
    databases.drop_database(name)
    databases.drop_api_role()


@pytest.fixture(scope="session")
def test_databases(template_db: str) -> Iterator[databases.Databases]:
    """This session's per-test databases: each a fresh clone of the template, or one a
    finished test left that is made a clone again (harness/databases.py says how)."""
    handed = databases.Databases(template_db, RUN_ID)
    yield handed
    handed.close()


@pytest.fixture
def database_url(test_databases: databases.Databases) -> Iterator[str]:
    name, url = test_databases.take()
    yield url
    db.reset_engine()
    test_databases.give_back(name)


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    eng = db.make_engine(database_url)
    yield eng
    eng.dispose()


@pytest.fixture
def world(engine: sa.Engine) -> World:
    return make_world(engine)


@pytest.fixture
def queue_prefix(services: None) -> Iterator[str]:
    prefix = f"tdt-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_client(services: None) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def settings(database_url: str, queue_prefix: str) -> Iterator[Settings]:
    """Process-wide settings pointing at this test's database and Redis prefix."""
    value = config.load_settings(
        {
            "DATABASE_URL": database_url,
            "REDIS_URL": REDIS_URL,
            "QUEUE_PREFIX": queue_prefix,
            "WORKER_INSTANCE_ID": "test-host",
        }
    )
    config.set_settings(value)
    db.reset_engine()
    yield value
    db.reset_engine()
    config.set_settings(None)


@pytest.fixture
def make_app(settings: Settings) -> Iterator[Callable[..., Celery]]:
    """Build the Celery app for this test; keyword overrides change settings first
    (for example ``retry_base_delay_s=0.2``), the way configuration variables would."""
    from tasks.celery_app import create_app

    apps: list[Celery] = []

    def build(**overrides: object) -> Celery:
        current = config.get_settings().with_overrides(**overrides)
        config.set_settings(current)
        db.reset_engine()
        app = create_app(current)
        apps.append(app)
        return app

    yield build
    for app in apps:
        app.close()


@pytest.fixture
def celery_app(make_app: Callable[..., Celery]) -> Celery:
    return make_app()
