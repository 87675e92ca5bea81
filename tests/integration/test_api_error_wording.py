"""Error answers say what is true. A cancelled or failed export will never have a CSV:
the download says so instead of "not complete yet". A body sent as JSON that does not
parse says it is not valid JSON; "must be a JSON object" is kept for valid JSON of the
wrong shape (and a missing body). Before, both ended runs answered "not complete yet" and
every unparsable body "must be a JSON object"."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from harness.factories import World
from tests.support.api_helpers import bearer, count_tasks, exports_url, task_in_state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("WAITING", "the export is not complete yet; its CSV is not available"),
        ("RUNNING", "the export is not complete yet; its CSV is not available"),
        ("FAILED", "the export failed; it has no CSV"),
        ("CANCELLED", "the export was cancelled; it has no CSV"),
    ],
)
def test_csv_of_an_unfinished_or_ended_export_says_which(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    state: str,
    message: str,
) -> None:
    task_id = task_in_state(engine, world, state)
    response = client.get(f"/api/tasks/{task_id}/csv", headers=bearer(tokens["staff"]))
    assert (response.status_code, response.json()) == (409, {"detail": message})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "the request body is not valid JSON"),
        (b'{"scope": "TEAM"', "the request body is not valid JSON"),
        (b"  ", "the request body is not valid JSON"),
        (b"\xa3\x8b\x89", "the request body is not valid JSON"),  # not UTF-8
        (b"[" * 60_000, "the request body is not valid JSON"),  # too deep to parse
        (b'["scope", "TEAM"]', "the request body must be a JSON object"),
        (b'"TEAM"', "the request body must be a JSON object"),
        (b"null", "the request body must be a JSON object"),
        (b"", "the request body must be a JSON object"),  # no body at all
    ],
    ids=[
        "garbage",
        "truncated",
        "blank",
        "not-utf8",
        "too-deep",
        "array",
        "string",
        "null",
        "empty",
    ],
)
def test_a_body_that_does_not_parse_says_so(
    client: TestClient,
    engine: sa.Engine,
    world: World,
    tokens: dict[str, str],
    raw: bytes,
    message: str,
) -> None:
    headers = {**bearer(tokens["staff"]), "Content-Type": "application/json"}
    response = client.post(exports_url(world.team_id), content=raw, headers=headers)
    assert (response.status_code, response.json()) == (422, {"detail": message})
    assert count_tasks(engine) == 0


def test_an_unparsable_body_without_a_token_is_still_401(client: TestClient, world: World) -> None:
    headers = {"Content-Type": "application/json"}
    response = client.post(exports_url(world.team_id), content=b"{not json", headers=headers)
    assert response.status_code == 401
