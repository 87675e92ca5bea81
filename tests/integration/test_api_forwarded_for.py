"""Failed authentications behind a proxy are counted against an address, never against
text the client wrote (issue "Security, round four", finding 7), in-process against real
Redis and PostgreSQL: ``X-Forwarded-For: evil-1, 127.0.0.1`` from a trusted peer made the
bucket ``ratelimit:auth:evil-1`` (one fresh bucket per invented name: no limit at all);
every hop trusted fell back to the client's own entry; and a 6to4 client had 65,536 /64
buckets per IPv4 address. The real server: tests/process/test_api_forwarded_hops.py."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from fastapi.testclient import TestClient

from api.app import create_api
from api.deps import MSG_AUTH_RATE
from harness.factories import World
from teamdesk.config import Settings
from tests.support.api_helpers import BAD_TOKEN, api_settings, bearer

FAILURES = 3


@contextmanager
def client_from(settings: Settings, peer: str, proxies: str = "127.0.0.1") -> Iterator[TestClient]:
    """An app instance trusting ``proxies``, reached from ``peer``."""
    limited = settings.with_overrides(auth_failures_per_min=FAILURES)
    networks = [ipaddress.ip_network(p) for p in proxies.split(",")]
    app = create_api(api_settings(limited), configure_logging=False, proxies=networks)
    with TestClient(app, client=(peer, 50000)) as client:
        yield client


def fail(client: TestClient, world: World, forwarded_for: str | None = None) -> int:
    headers = bearer(BAD_TOKEN)
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return client.get(f"/api/teams/{world.team_id}/tasks", headers=headers).status_code


def auth_buckets(redis_client: redis.Redis, prefix: str) -> set[str]:
    found = redis_client.scan_iter(match=f"{prefix}:ratelimit:auth:*")
    return {key.removeprefix(f"{prefix}:ratelimit:auth:") for key in found}


def test_invented_names_in_front_of_a_trusted_hop_share_the_hops_budget(
    settings: Settings,
    world: World,
    tokens: dict[str, str],
    redis_client: redis.Redis,
    queue_prefix: str,
) -> None:
    with client_from(settings, "127.0.0.1") as client:
        statuses = [fail(client, world, f"evil-{i}, 127.0.0.1") for i in range(FAILURES + 2)]
        assert statuses == [401] * FAILURES + [429, 429]
        limited = client.get(
            f"/api/teams/{world.team_id}/tasks",
            headers={**bearer(BAD_TOKEN), "X-Forwarded-For": "evil-99"},
        )
        assert limited.status_code == 429 and limited.json() == {"detail": MSG_AUTH_RATE}
        served = client.get(
            f"/api/teams/{world.team_id}/tasks",
            headers={**bearer(tokens["staff"]), "X-Forwarded-For": "evil-1, 127.0.0.1"},
        )
        assert served.status_code == 200  # a live token is served all the same
    assert auth_buckets(redis_client, queue_prefix) == {"127.0.0.1"}


def test_every_hop_trusted_takes_the_nearest_hop_not_the_clients_own_entry(
    settings: Settings, world: World, redis_client: redis.Redis, queue_prefix: str
) -> None:
    with client_from(settings, "10.0.0.9", proxies="10.0.0.0/8") as client:
        statuses = [fail(client, world, f"10.6.6.{i}, 10.0.0.5") for i in range(FAILURES + 1)]
        assert statuses == [401] * FAILURES + [429]
    assert auth_buckets(redis_client, queue_prefix) == {"10.0.0.5"}


def test_a_6to4_host_has_one_budget_for_all_its_64s(
    settings: Settings, world: World, redis_client: redis.Redis, queue_prefix: str
) -> None:
    for i in range(FAILURES):  # 2002:cb00:7105::/48 is the IPv4 host 203.0.113.5
        with client_from(settings, "127.0.0.1") as client:
            assert fail(client, world, f"2002:cb00:7105:{i:x}::1") == 401
    with client_from(settings, "127.0.0.1") as client:
        assert fail(client, world, "2002:cb00:7105:ffff::2") == 429
        assert fail(client, world, "203.0.113.5") == 429  # the IPv4 host itself
        assert fail(client, world, "2002:cb00:7106::1") == 401  # another host
    assert auth_buckets(redis_client, queue_prefix) == {"203.0.113.5", "203.0.113.6"}


def test_a_peer_that_is_not_an_address_gets_no_bucket_of_its_own_name(
    settings: Settings, world: World, redis_client: redis.Redis, queue_prefix: str
) -> None:
    with client_from(settings, "evil-peer") as client:
        assert fail(client, world) == 401
    assert auth_buckets(redis_client, queue_prefix) == {"unknown"}
