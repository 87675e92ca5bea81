"""The API's health routes in-process against real PostgreSQL and Redis.

``/api/health`` (``no-store``; the running version in both answers; 503 without details
and within budget when the database port is closed or never answers; Redis not needed),
``/api/workers/health`` saying which roles are live and which are missing, and the bounded
checks behind both (a deadline per check, a cap on the checks in flight). Concurrent
probes share one check: 100 at once all answer 200 against a healthy database, and all
answer 503 in time against a frozen one (a proxy that accepts and never answers) with the
checks started bounded; a pass is reused only while younger than HEALTH_CACHE_S.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import tomllib
from pathlib import Path
from typing import cast

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.bounded import MAX_CHECKS_IN_FLIGHT, BoundedChecks, CheckFailed, SharedCheck
from api.resources import HEALTH_CACHE_S, Resources
from dispatcher.leader import Leadership, leader_key
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat, WorkerSlots
from teamdesk.version import version
from tests.support.api_helpers import api_client, closed_port, silent_listener
from tests.support.freezable_proxy import freezable_proxy

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# The check's own deadline (api/health.py, CHECK_DEADLINE_S: 2 s) and a margin for the
# answers themselves: 100 concurrent requests through one in-process app on a busy 2-core
# machine took 3.02 s once (a CI run of make test). A frozen database without the
# deadline holds a probe until TCP gives up, minutes.
HEALTH_BUDGET_S = 4.0
OK = {"status": "ok", "version": version()}
UNAVAILABLE = {"status": "unavailable", "version": version()}
CONCURRENT_PROBES = 100
JOIN_TIMEOUT_S = 30.0  # only detects a request that never came back


def resources_of(client: TestClient) -> Resources:
    return cast(Resources, cast(FastAPI, client.app).state.resources)


def concurrent_gets(client: TestClient, path: str, count: int) -> list[tuple[int, float]]:
    """``count`` GETs of ``path`` sent at once (a barrier), each as (status, seconds taken)."""
    start = threading.Barrier(count, timeout=JOIN_TIMEOUT_S)
    answers: list[tuple[int, float]] = []
    lock = threading.Lock()

    def probe() -> None:
        start.wait()
        began = time.monotonic()
        status = client.get(path).status_code
        with lock:
            answers.append((status, time.monotonic() - began))

    threads = [threading.Thread(target=probe, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert len(answers) == count, "some probes never came back"
    return answers


def tally(answers: list[tuple[int, float]]) -> dict[int, int]:
    statuses = [status for status, _ in answers]
    return {status: statuses.count(status) for status in sorted(set(statuses))}


# --- /api/health ------------------------------------------------------------------------


def test_health_ok_says_no_store(client: TestClient) -> None:
    response = client.get("/api/health")
    assert response.status_code == 200
    assert response.json() == OK
    assert response.headers["Cache-Control"] == "no-store"


def _assert_unavailable_without_details(settings: Settings, port: int) -> None:
    broken = settings.with_overrides(database_url=f"postgresql://postgres@127.0.0.1:{port}/x")
    with api_client(broken) as client:
        started = time.monotonic()
        response = client.get("/api/health")
        elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json() == UNAVAILABLE
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
        assert client.get("/api/health").json() == OK


def test_health_says_the_version_pyproject_gives(client: TestClient) -> None:
    """The version in the answers (OK, UNAVAILABLE above) is the one being released, so a
    rollout can be watched from the probe."""
    released = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert client.get("/api/health").json() == {"status": "ok", "version": released}


def test_the_openapi_document_shows_the_version_in_both_answers(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    answers = document["paths"]["/api/health"]["get"]["responses"]
    for status in ("200", "503"):
        ref = answers[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/HealthOut", status
    schema = document["components"]["schemas"]["HealthOut"]
    assert schema["required"] == ["status", "version"]
    assert schema["properties"]["version"]["type"] == "string"


# --- concurrent probes: one shared check ------------------------------------------------


@pytest.mark.parametrize("path", ["/api/health", "/api/workers/health"])
def test_concurrent_probes_all_answer_200_in_time(client: TestClient, path: str) -> None:
    answers = concurrent_gets(client, path, CONCURRENT_PROBES)
    assert tally(answers) == {200: CONCURRENT_PROBES}
    assert max(seconds for _, seconds in answers) < HEALTH_BUDGET_S


def test_a_frozen_database_answers_concurrent_probes_503_in_time_with_checks_bounded(
    settings: Settings,
) -> None:
    with freezable_proxy(settings.database_url) as proxy:
        proxy.freeze()
        behind = settings.with_overrides(database_url=proxy.url_for(settings.database_url))
        with api_client(behind) as client:
            checks = resources_of(client).database_check.runner
            answers = concurrent_gets(client, "/api/health", CONCURRENT_PROBES)
            assert tally(answers) == {503: CONCURRENT_PROBES}
            assert max(seconds for _, seconds in answers) < HEALTH_BUDGET_S
            # However many probes arrive, the checks (threads) they start stay capped.
            assert 1 <= checks.started <= MAX_CHECKS_IN_FLIGHT
            assert checks.most_in_flight <= MAX_CHECKS_IN_FLIGHT
            assert 1 <= proxy.held <= checks.started  # the checks did reach the "database"
            proxy.thaw()
            # Every probe gave up on the frozen check, so the next one checks afresh.
            response = client.get("/api/health")
            assert (response.status_code, response.json()) == (200, OK)


def test_a_pass_is_reused_only_while_younger_than_health_cache_s(client: TestClient) -> None:
    now = [100.0]
    res = resources_of(client)
    res.database_check = SharedCheck(fresh_s=HEALTH_CACHE_S, clock=lambda: now[0])
    checks = res.database_check.runner
    assert client.get("/api/health").status_code == 200
    assert checks.started == 1
    now[0] += HEALTH_CACHE_S - 0.001
    assert client.get("/api/health").status_code == 200
    assert checks.started == 1  # answered with the pass, 0.999 s old
    now[0] += 0.001
    assert client.get("/api/health").status_code == 200
    assert checks.started == 2  # the pass reached HEALTH_CACHE_S: checked again


# --- /api/workers/health ----------------------------------------------------------------


def roles(workers: bool, dispatcher: bool, exports: int, reminders: int) -> dict[str, object]:
    queues = (("exports", exports), ("reminders", reminders))
    missing = [] if dispatcher else ["dispatcher"]
    missing += [f"{q} worker" for q, n in queues if not n]
    problems = [] if dispatcher else ["no dispatcher is running (start one: celery -A tasks beat)"]
    problems += [f"no worker consumes {q}" for q, n in queues if not n]
    return {
        "workers": workers,
        "dispatcher": dispatcher,
        "consumers": {"exports": exports, "reminders": reminders},
        "missing": missing,
        "problems": problems,
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


def test_concurrent_callers_share_the_check_in_flight() -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)
    shared: SharedCheck[str] = SharedCheck()

    def hang() -> str:
        entered.release()
        release.wait()
        return "ok"

    async def scenario() -> None:
        callers = [asyncio.create_task(shared.run(hang, 30.0)) for _ in range(20)]
        loop = asyncio.get_running_loop()
        # Gate: the first caller's check runs; the other 19 were scheduled before it.
        assert await loop.run_in_executor(None, entered.acquire, True, 10)
        try:
            assert shared.runner.started == 1
            assert not any(caller.done() for caller in callers)
        finally:
            release.set()
        assert await asyncio.gather(*callers) == ["ok"] * 20
        assert shared.runner.started == 1

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_a_hung_check_is_joined_until_the_deadline_then_replaced_up_to_the_cap() -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)
    deadline_s = 30.0  # the callers' real wait is never reached; the clock is scripted
    # One reading per call, in call order: joins at 29.999, replaced at 30, no slot at 60.
    readings = iter([0.0, deadline_s - 0.001, deadline_s, 2 * deadline_s, 2 * deadline_s])
    shared: SharedCheck[str] = SharedCheck(BoundedChecks(max_in_flight=2), clock=readings.__next__)

    def hang() -> str:
        entered.release()
        release.wait()
        return "ok"

    async def scenario() -> None:
        callers = [asyncio.create_task(shared.run(hang, deadline_s)) for _ in range(3)]
        loop = asyncio.get_running_loop()
        for _ in range(2):  # Gate: two checks hang (the second caller joined the first)
            assert await loop.run_in_executor(None, entered.acquire, True, 10)
        try:
            assert (shared.runner.started, shared.runner.in_flight) == (2, 2)
            started = time.monotonic()
            with pytest.raises(CheckFailed):  # both slots hung: fails at once
                await shared.run(hang, deadline_s)
            assert time.monotonic() - started < 1.0
            assert shared.runner.started == 2
        finally:
            release.set()
        assert await asyncio.gather(*callers) == ["ok"] * 3
        assert await shared.run(lambda: "again", deadline_s) == "again"
        assert (shared.runner.started, shared.runner.most_in_flight) == (3, 2)

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_neither_a_failure_nor_a_pass_older_than_fresh_s_is_reused() -> None:
    now = [0.0]
    shared: SharedCheck[str] = SharedCheck(fresh_s=HEALTH_CACHE_S, clock=lambda: now[0])

    def slow_pass() -> str:
        now[0] += HEALTH_CACHE_S  # the check itself took HEALTH_CACHE_S
        return "slow"

    def fail() -> str:
        raise RuntimeError("refused")

    async def scenario() -> None:
        assert await shared.run(slow_pass, 5.0) == "slow"
        # Its age counts from the check's start: already HEALTH_CACHE_S, so not reused.
        assert await shared.run(lambda: "fresh", 5.0) == "fresh"
        now[0] += HEALTH_CACHE_S
        with pytest.raises(CheckFailed):
            await shared.run(fail, 5.0)
        assert await shared.run(lambda: "recovered", 5.0) == "recovered"
        assert shared.runner.started == 4

    asyncio.run(scenario())
