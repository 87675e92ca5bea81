"""OpenAPI fuzzing of the HTTP API with schemathesis: no request may produce a 5xx.

The app runs in-process (ASGI) on this test's own database, with a staff member's token
on every request. Path ids and the reminder's ticket are drawn from real rows most of
the time (schemathesis dictionaries), so the fuzzer reaches the routes' real work, not
only their 404s. Hypothesis is derandomized and bounded, so a run is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode

from api.app import create_api
from harness.factories import World, add_ticket
from teamdesk.config import Settings
from tests.support.api_helpers import api_settings, bearer, make_tokens, task_in_state

EXAMPLES_PER_OPERATION = 100
# One token makes every request: its rate limit stays on (the limiter runs on every
# request) but large enough that each operation still reaches real work.
FUZZ_RATE_PER_MIN = 100_000
REAL_ID_PROBABILITY = 0.7
# Operations without parameters or body: nothing to make invalid.
NO_INPUT = ("/api/health", "/api/workers/health")


def _fuzz_config(world: World, tasks: list[str], ticket: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": 20260105,
            "dictionaries": {
                "teams": {"values": [str(world.team_id)]},
                "tasks": {"values": tasks},
                "tickets": {"values": [ticket]},
            },
            "parameters": {
                "path.team_id": {"dictionary": "teams", "probability": REAL_ID_PROBABILITY},
                "path.task_id": {"dictionary": "tasks", "probability": REAL_ID_PROBABILITY},
                "body.ticket_id": {"dictionary": "tickets", "probability": REAL_ID_PROBABILITY},
            },
        }
    )


@pytest.fixture
def staff_token(engine: sa.Engine, world: World) -> str:
    return make_tokens(engine, world)["staff"]


@pytest.fixture
def api_schema(engine: sa.Engine, world: World, settings: Settings) -> Iterator[Any]:
    tasks = [
        task_in_state(engine, world, state, kind=kind)
        for state in ("WAITING", "RUNNING", "FAILED", "CANCELLED", "COMPLETED")
        for kind in ("EXPORT", "REMINDER")
    ]
    with engine.begin() as conn:
        ticket = add_ticket(conn, world.team_id, world.customer_id, "=fuzzed")
    fuzz_settings = settings.with_overrides(  # reads too: the fuzzer reads fast
        api_rate_per_min=FUZZ_RATE_PER_MIN,
        api_rate_burst=FUZZ_RATE_PER_MIN,
        api_read_rate_per_min=FUZZ_RATE_PER_MIN,
        api_read_burst=FUZZ_RATE_PER_MIN,
    )
    app = create_api(api_settings(fuzz_settings), configure_logging=False)
    config = _fuzz_config(world, [str(t) for t in tasks], str(ticket))
    yield schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    app.state.resources.close()  # schemathesis keeps the app's lifespan open until exit


def _fuzz(operation: Any, mode: GenerationMode, token: str) -> set[int]:
    """Run the operation's examples; returns the statuses seen."""
    statuses: set[int] = set()

    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call_and_validate(headers=bearer(token), checks=[not_a_server_error])
        statuses.add(response.status_code)

    run()
    return statuses


# schemathesis' own pytest wrapper (`schemathesis.pytest.from_fixture`) does not run under
# pytest 9 yet, so each operation gets a plain Hypothesis test from its strategy.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_request_makes_a_server_error(
    api_schema: Any, staff_token: str, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 9
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.path in NO_INPUT:
            continue
        statuses = _fuzz(operation, mode, staff_token)
        if mode is GenerationMode.POSITIVE:  # the fuzzer reached real work, not only 404s
            assert any(200 <= status < 300 for status in statuses), (operation.label, statuses)
