"""teamdesk/tracing.py without the SDK: when the environment asks for traces, and what a
stored or received ``traceparent`` may be (anything: it must never fail a run)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace

from teamdesk import tracing

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        (ENDPOINT, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": " TRUE "}, False),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, True),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "console"}, False),  # not shipped: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ],
)
def test_traces_are_on_only_when_the_environment_asks(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


@pytest.mark.parametrize(
    "parent",
    [None, "", "garbage", 123, ["00-x"], {"traceparent": VALID}, b"00-ab", "00-" + "0" * 55],
)
def test_a_traceparent_that_names_no_span_is_none(parent: Any) -> None:
    assert tracing.context_of(parent) is None
    assert tracing.links_to(parent) == []


def test_a_traceparent_names_its_span() -> None:
    context = tracing.context_of(VALID)
    assert context is not None
    found = trace.get_current_span(context).get_span_context()
    assert (f"{found.trace_id:032x}", f"{found.span_id:016x}", found.trace_flags) == (
        VALID.split("-")[1],
        VALID.split("-")[2],
        1,
    )
    assert [f"{link.context.trace_id:032x}" for link in tracing.links_to(VALID)] == [
        VALID.split("-")[1]
    ]


def test_off_nothing_is_started_or_stored() -> None:
    assert not tracing.enabled()
    with tracing.span("anything", parent=VALID, task_id="x") as current:
        assert current is None
        assert tracing.current_parent() is None
        assert tracing.log_fields() == {}
        tracing.event("ignored")
