"""The API's rate limits (api/limits.py, docs/design.md "HTTP API") against real Redis and
PostgreSQL: create, retry and cancel per token; failed authentications per client
address (an IPv6 client's /64), which never refuse a live token; both shared by two app
instances on one Redis prefix (two replicas), and both open (with one log line) when
Redis is away.
Limits are set small through the configuration variables; nothing here sleeps."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_api
from api.deps import MSG_AUTH_RATE, MSG_TOKEN_RATE
from harness.factories import World, task_row
from teamdesk.config import Settings
from tests.support.api_helpers import (
    BAD_TOKEN,
    api_settings,
    bearer,
    closed_port,
    count_tasks,
    exports_url,
    silent_listener,
    task_in_state,
)
from tests.support.tokens import token_row

TEAM_EXPORT = {"scope": "TEAM"}
BURST = 2
AUTH_FAILURES = 3
# A Redis that never answers costs one socket timeout (api/resources.py, 1 s), then the
# limiter stops asking for a while: a few requests must take far less than one each.
FROZEN_REDIS_BOUND_S = 4.0


def _limited(settings: Settings, **overrides: Any) -> Settings:
    small = {
        "api_rate_per_min": 1,
        "api_rate_burst": BURST,
        "auth_failures_per_min": AUTH_FAILURES,
        **overrides,
    }
    return settings.with_overrides(**small)


@contextmanager
def app_client(settings: Settings, address: str = "203.0.113.7") -> Iterator[TestClient]:
    """An app instance (a replica) seen from one client address."""
    app = create_api(api_settings(settings), configure_logging=False)
    with TestClient(app, client=(address, 50000)) as test_client:
        yield test_client


def assert_limited(response: Any, message: str) -> None:
    assert response.status_code == 429, response.text
    assert response.json() == {"detail": message}
    assert 1 <= int(response.headers["Retry-After"]) <= 60


# --- per token -----------------------------------------------------------------------------


def test_create_retry_and_cancel_share_one_budget_per_token(
    settings: Settings,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    staff = bearer(tokens["staff"])
    team_exports = exports_url(world.team_id)
    failed = task_in_state(engine, world, "FAILED")
    running = task_in_state(engine, world, "RUNNING")
    with app_client(_limited(settings)) as client:
        for _ in range(BURST):
            assert client.post(team_exports, json=TEAM_EXPORT, headers=staff).status_code == 201
        tasks, rows = count_tasks(engine), (task_row(engine, failed), task_row(engine, running))
        used = token_row(engine, tokens["staff"])

        assert_limited(client.post(team_exports, json=TEAM_EXPORT, headers=staff), MSG_TOKEN_RATE)
        assert_limited(client.post(f"/api/tasks/{failed}/retry", headers=staff), MSG_TOKEN_RATE)
        assert_limited(client.post(f"/api/tasks/{running}/cancel", headers=staff), MSG_TOKEN_RATE)
        assert count_tasks(engine) == tasks
        assert (task_row(engine, failed), task_row(engine, running)) == rows
        assert token_row(engine, tokens["staff"])["xmin"] == used["xmin"]

        assert client.get(f"/api/tasks/{failed}", headers=staff).status_code == 200  # reads: free
        other = client.post(f"/api/tasks/{failed}/retry", headers=bearer(tokens["staff2"]))
        assert other.status_code == 202  # another token, another budget
    # One key per token under the cluster's prefix, expiring when its bucket is full again.
    keys = set(redis_client.scan_iter(match=f"{queue_prefix}:ratelimit:token:*"))
    ids = [token_row(engine, tokens[name])["id"] for name in ("staff", "staff2")]
    assert keys == {f"{queue_prefix}:ratelimit:token:{token_id}" for token_id in ids}
    assert all(0 < redis_client.pttl(key) <= BURST * 60_000 for key in keys)


def test_zero_turns_one_limit_off_and_not_the_other(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    url = f"/api/teams/{world.team_id}/tasks"
    with app_client(_limited(settings, api_rate_per_min=0)) as client:
        for _ in range(BURST + 2):
            created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
            assert created.status_code == 201, created.text
        for _ in range(AUTH_FAILURES):
            assert client.get(url, headers=bearer(BAD_TOKEN)).status_code == 401
        assert_limited(client.get(url, headers=bearer(BAD_TOKEN)), MSG_AUTH_RATE)
    assert count_tasks(engine) == BURST + 2


# --- per client address, for failed authentication ------------------------------------------


def test_failed_authentications_are_refused_but_never_lock_out_a_live_token(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    """Behind an ingress every client may share one address: its failed authentications
    run out of budget (429 instead of 401), while a live token from that same address is
    served as usual. Before, the address was refused before its token was looked up, so
    anyone could lock every user out."""
    url = f"/api/teams/{world.team_id}/tasks"
    staff = bearer(tokens["staff"])
    with (
        app_client(_limited(settings)) as client,
        app_client(_limited(settings), address="198.51.100.9") as neighbour,
    ):
        for _ in range(AUTH_FAILURES * 3):  # successes take nothing from the budget
            assert client.get(url, headers=staff).status_code == 200
        failures = [
            client.get(url, headers=bearer(BAD_TOKEN)),
            client.get(url),  # no token at all
            client.post(  # the 401-before-422 path
                exports_url(world.team_id),
                content=b"{",
                headers={**bearer(BAD_TOKEN), "Content-Type": "application/json"},
            ),
        ]
        assert [r.status_code for r in failures] == [401] * AUTH_FAILURES
        assert_limited(client.get(url, headers=bearer(BAD_TOKEN)), MSG_AUTH_RATE)
        assert_limited(client.get(url), MSG_AUTH_RATE)
        assert_limited(
            client.post(
                exports_url(world.team_id),
                content=b"{",
                headers={**bearer(BAD_TOKEN), "Content-Type": "application/json"},
            ),
            MSG_AUTH_RATE,
        )
        # A live token from the blocked address: served, created, validated as usual.
        assert client.get(url, headers=staff).status_code == 200
        created = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
        assert created.status_code == 201, created.text
        invalid = client.post(
            exports_url(world.team_id),
            content=b"{",
            headers={**staff, "Content-Type": "application/json"},
        )
        assert invalid.status_code == 422, invalid.text
        assert_limited(client.get(url, headers=bearer(BAD_TOKEN)), MSG_AUTH_RATE)  # still
        assert neighbour.get(url, headers=bearer(BAD_TOKEN)).status_code == 401  # its own
    assert count_tasks(engine) == 1


def test_an_ipv6_client_is_counted_by_its_64(
    settings: Settings, world: World, tokens: dict[str, str]
) -> None:
    """A host picks any address of its /64 per request: the budget is the /64's."""
    url = f"/api/teams/{world.team_id}/tasks"
    limited = _limited(settings)
    for i in range(AUTH_FAILURES):
        with app_client(limited, address=f"2001:db8:1:2::{i + 1:x}") as client:
            assert client.get(url, headers=bearer(BAD_TOKEN)).status_code == 401
    with app_client(limited, address="2001:db8:1:2:ffff::9") as same_64:
        assert_limited(same_64.get(url, headers=bearer(BAD_TOKEN)), MSG_AUTH_RATE)
        assert same_64.get(url, headers=bearer(tokens["staff"])).status_code == 200
    with app_client(limited, address="2001:db8:1:3::1") as next_64:
        assert next_64.get(url, headers=bearer(BAD_TOKEN)).status_code == 401


# --- across replicas ----------------------------------------------------------------------


def test_two_app_instances_share_the_limits(
    settings: Settings, engine: sa.Engine, world: World, tokens: dict[str, str]
) -> None:
    staff = bearer(tokens["staff"])
    team_exports = exports_url(world.team_id)
    url = f"/api/teams/{world.team_id}/tasks"
    with app_client(_limited(settings)) as one, app_client(_limited(settings)) as two:
        assert one.post(team_exports, json=TEAM_EXPORT, headers=staff).status_code == 201
        assert two.post(team_exports, json=TEAM_EXPORT, headers=staff).status_code == 201
        assert_limited(one.post(team_exports, json=TEAM_EXPORT, headers=staff), MSG_TOKEN_RATE)
        assert_limited(two.post(team_exports, json=TEAM_EXPORT, headers=staff), MSG_TOKEN_RATE)

        for replica in (one, two, one):
            assert replica.get(url, headers=bearer(BAD_TOKEN)).status_code == 401
        assert_limited(two.get(url, headers=bearer(BAD_TOKEN)), MSG_AUTH_RATE)
        assert two.get(url, headers=staff).status_code == 200  # a live token: served
    assert count_tasks(engine) == BURST


# --- Redis away: fail open ----------------------------------------------------------------


def test_without_redis_the_limits_are_open_and_say_so_once(
    settings: Settings,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    no_redis = _limited(settings, redis_url=f"redis://127.0.0.1:{closed_port()}/0")
    caplog.set_level(logging.WARNING, logger="api.limits")
    with app_client(no_redis) as client:
        for _ in range(BURST + 2):
            response = client.post(
                exports_url(world.team_id), json=TEAM_EXPORT, headers=bearer(tokens["staff"])
            )
            assert response.status_code == 201, response.text
        for _ in range(AUTH_FAILURES + 1):
            assert client.get("/api/tasks/x", headers=bearer(BAD_TOKEN)).status_code == 401
    warnings = [r for r in caplog.records if r.name == "api.limits"]
    assert [r.getMessage() for r in warnings] == ["rate limits not applied: Redis unavailable"]
    assert count_tasks(engine) == BURST + 2


def test_a_frozen_redis_holds_requests_only_briefly(
    settings: Settings,
    world: World,
    tokens: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="api.limits")
    with silent_listener() as port:
        frozen = _limited(settings, redis_url=f"redis://127.0.0.1:{port}/0")
        with app_client(frozen) as client:
            started = time.monotonic()
            for _ in range(BURST + 2):
                response = client.post(
                    exports_url(world.team_id), json=TEAM_EXPORT, headers=bearer(tokens["staff"])
                )
                assert response.status_code == 201, response.text
            took = time.monotonic() - started
    assert took < FROZEN_REDIS_BOUND_S
    warnings = [r for r in caplog.records if r.name == "api.limits"]
    assert [r.getMessage() for r in warnings] == ["rate limits not applied: Redis unavailable"]
    assert warnings[0].__dict__["error"] == "TimeoutError"
