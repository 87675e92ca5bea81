"""The API's rate limits when Redis refuses the API's user a permission (api/limits.py):
they fail closed. A wrong ACL (a user missing the limiter's script command, or a command
its script runs) must not silently switch the limits off, as an unreachable Redis does
(tests/integration/test_api_rate_limits.py: open, one warning). So every limited request
answers 503, the service's "temporarily unavailable" (api/errors.py), nothing is written,
and one error names the missing permission however many requests it refuses; once the
permission is back the API serves again, without a restart.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from api.errors import MSG_UNAVAILABLE
from api.limits import SCRIPT_DENIED
from harness.factories import World
from teamdesk.config import Settings
from tests.support.api_helpers import BAD_TOKEN, api_client, bearer, count_tasks, exports_url
from tests.support.redis_users import AclRedis, redis_with_users

TEAM_EXPORT = {"scope": "TEAM"}


@pytest.fixture
def acl_redis() -> Iterator[AclRedis]:
    with redis_with_users(f"tdt-{uuid.uuid4().hex[:8]}") as server:
        yield server


# (what the API's user loses, the command Redis then names)
TAKEN = [("-evalsha", "evalsha"), ("-set", "set")]  # the limiter's script; a command it runs


@pytest.mark.parametrize(("rule", "command"), TAKEN, ids=[rule for rule, _ in TAKEN])
def test_a_missing_permission_closes_the_limits_and_is_named_once(
    settings: Settings,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    acl_redis: AclRedis,
    caplog: pytest.LogCaptureFixture,
    rule: str,
    command: str,
) -> None:
    api_user = f"{acl_redis.prefix}-api"
    acl_redis.admin().execute_command("ACL", "SETUSER", api_user, rule)
    api = settings.with_overrides(
        redis_url=acl_redis.url("api"), queue_prefix=acl_redis.prefix, api_rate_per_min=60
    )
    staff = bearer(tokens["staff"])
    caplog.set_level(logging.WARNING, logger="api.limits")
    with api_client(api) as client:
        refused = [client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)]
        refused += [client.get("/api/tasks/x", headers=bearer(BAD_TOKEN)) for _ in "ab"]
        refused += [client.get(f"/api/teams/{world.team_id}/tasks", headers=staff)]
        acl_redis.admin().execute_command("ACL", "SETUSER", api_user, "+" + rule[1:])
        served = client.post(exports_url(world.team_id), json=TEAM_EXPORT, headers=staff)
    assert [(r.status_code, r.json()) for r in refused] == [(503, {"detail": MSG_UNAVAILABLE})] * 4
    assert {r.headers["retry-after"] for r in refused} == {"5"}
    assert served.status_code == 201, served.text
    assert count_tasks(engine) == 1  # the refused creation wrote nothing
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "api.limits"]
    assert said == [("ERROR", "rate limits failed closed: the API's Redis user lacks a permission")]
    # Redis's own words: the command by name (inside a script only from Redis 7.2 on; 7.0
    # says the script's user "can't run this command", and its ACL LOG names it).
    permission = caplog.records[-1].__dict__["permission"]
    assert f"'{command}'" in permission or SCRIPT_DENIED in permission
