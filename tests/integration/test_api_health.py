"""The API's health routes in-process against real PostgreSQL and Redis.

``/api/health`` (never cached; 503 without details and within budget when the database
port is closed or never answers; Redis not needed), ``/api/workers/health`` saying which
roles are live and which are missing, and the bounded checks behind both (a deadline per
check, a cap on the checks in flight).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest
import redis
from fastapi.testclient import TestClient

from api.bounded import BoundedChecks, CheckFailed
from dispatcher.heartbeat import Heartbeat, WorkerSlots
from dispatcher.leader import Leadership, leader_key
from teamdesk.config import Settings
from tests.support.api_helpers import api_client, closed_port, silent_listener

HEALTH_BUDGET_S = 3.0


# --- /api/health ------------------------------------------------------------------------


def test_health_ok_is_never_cached(client: TestClient) -> None:
    response = client.get("/api/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert response.headers["Cache-Control"] == "no-store"


def _assert_unavailable_without_details(settings: Settings, port: int) -> None:
    broken = settings.with_overrides(database_url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with api_client(broken) as client:
        started = time.monotonic()
        response = client.get("/api/health")
        elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable"}
    assert response.headers["Cache-Control"] == "no-store"
    for leak in ("127.0.0.1", str(port), "postgres", "Error", "connect"):
        assert leak not in response.text
    assert elapsed < HEALTH_BUDGET_S, elapsed


def test_health_503_when_the_database_port_is_closed(settings: Settings) -> None:
    _assert_unavailable_without_details(settings, closed_port())


def test_health_503_within_budget_when_the_database_never_answers(settings: Settings) -> None:
    with silent_listener() as port:
        _assert_unavailable_without_details(settings, port)


def test_health_does_not_need_redis(settings: Settings) -> None:
    no_redis = settings.with_overrides(redis_url=f"redis://127.0.0.1:{closed_port()}/0")
    with api_client(no_redis) as client:
        assert client.get("/api/health").json() == {"status": "ok"}


# --- /api/workers/health ----------------------------------------------------------------


def roles(workers: bool, dispatcher: bool, exports: int, reminders: int) -> dict[str, object]:
    missing = [] if dispatcher else ["dispatcher"]
    missing += [f"{q} worker" for q, n in (("exports", exports), ("reminders", reminders)) if not n]
    return {
        "workers": workers,
        "dispatcher": dispatcher,
        "consumers": {"exports": exports, "reminders": reminders},
        "missing": missing,
    }


def test_workers_health_says_which_roles_are_live_and_which_are_missing(
    client: TestClient, settings: Settings, redis_client: redis.Redis
) -> None:
    response = client.get("/api/workers/health")
    assert (response.status_code, response.json()) == (200, roles(False, False, 0, 0))
    assert response.headers["Cache-Control"] == "no-store"
    prefix, ttl = settings.queue_prefix, settings.heartbeat_ttl_s
    exporter = Heartbeat(redis_client, prefix, "api-test", ttl, WorkerSlots(("exports",), 2))
    assert exporter.renew()
    assert client.get("/api/workers/health").json() == roles(True, False, 2, 0)
    leader = Leadership(redis_client, leader_key(prefix), 15)
    assert leader.ensure()
    mixed = WorkerSlots(("exports", "reminders"), 3)
    both = Heartbeat(redis_client, prefix, "api-test", ttl, mixed)
    assert both.renew()
    assert client.get("/api/workers/health").json() == roles(True, True, 5, 3)
    exporter.remove(draining=True)  # a draining worker takes no new work
    both.remove()
    leader.release()
    assert client.get("/api/workers/health").json() == roles(False, False, 0, 0)


def test_workers_health_503_when_redis_is_unreachable(settings: Settings) -> None:
    port = closed_port()
    with api_client(settings.with_overrides(redis_url=f"redis://127.0.0.1:{port}/0")) as client:
        started = time.monotonic()
        response = client.get("/api/workers/health")
        elapsed = time.monotonic() - started
    assert (response.status_code, response.json()) == (503, {"workers": None})
    assert response.headers["Cache-Control"] == "no-store"
    assert str(port) not in response.text
    assert elapsed < HEALTH_BUDGET_S


# --- bounded health checks --------------------------------------------------------------------


def test_a_hung_check_answers_at_its_deadline_and_in_flight_checks_are_capped() -> None:
    release = threading.Event()
    running = [threading.Event(), threading.Event()]
    checks = BoundedChecks(max_in_flight=2)

    def hang(started: threading.Event) -> bool:
        started.set()
        return release.wait()

    async def scenario() -> None:
        hung = [asyncio.create_task(checks.run(functools.partial(hang, e), 30.0)) for e in running]
        # Gate: both checks hold their slot (the slot is taken before the thread starts).
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, lambda: all(e.wait(10) for e in running))
        started = time.monotonic()
        with pytest.raises(CheckFailed):  # no slot left: fails at once, no thread started
            await checks.run(lambda: True, 30.0)
        assert time.monotonic() - started < 1.0
        assert not any(task.done() for task in hung)
        release.set()
        assert await asyncio.gather(*hung) == [True, True]
        assert await checks.run(lambda: 7, 5.0) == 7

    asyncio.run(scenario())


def test_a_check_overrunning_its_deadline_fails() -> None:
    release = threading.Event()
    checks = BoundedChecks()

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(CheckFailed) as failed:
            await checks.run(release.wait, 0.2)
        assert isinstance(failed.value.__cause__, TimeoutError)
        assert time.monotonic() - started < 2.0

    asyncio.run(scenario())
    release.set()
