"""JSON log lines (docs/design.md, "Logs"): fields, levels and redaction, asserted on
captured output."""

from __future__ import annotations

import inspect
import io
import json
import logging
from collections.abc import Iterator

import pytest
from celery.worker.consumer.consumer import Consumer
from kombu.message import Message

from teamdesk.logs import REDACTED, log_event, redact_text, setup_logging


@pytest.fixture
def capture() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_event_line_has_spec_fields(capture: io.StringIO) -> None:
    setup_logging("worker", "info", capture)
    log_event(logging.getLogger("t"), "task.started", task_id="T", run=0, attempt=1)
    (line,) = lines(capture)
    assert list(line)[:5] == ["time", "level", "event", "service", "pid"]
    assert (line["level"], line["event"], line["service"]) == ("info", "task.started", "worker")
    assert (line["task_id"], line["run"], line["attempt"]) == ("T", 0, 1)
    assert isinstance(line["pid"], int)
    assert str(line["time"]).endswith("Z") and "T" in str(line["time"])


def test_uvicorns_color_copy_of_a_line_is_dropped(capture: io.StringIO) -> None:
    """uvicorn logs "Started server process" with a ``color_message`` copy full of
    terminal escapes, before the API's startup could filter anything; the JSON line keeps
    the plain message only."""
    setup_logging("api", "info", capture)
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 7, extra={"color_message": "Started [\x1b[36m%d\x1b[0m]"}
    )
    (line,) = lines(capture)
    assert line["message"] == "Started server process [7]" and "color_message" not in line


def test_secrets_are_redacted(capture: io.StringIO) -> None:
    setup_logging("api", "info", capture)
    log = logging.getLogger("t")
    log_event(
        log,
        "dispatcher.failed",
        database="postgresql://app:hunter2@db:5432/teamdesk",
        headers={"Authorization": "Bearer abc.def", "Accept": "text/csv"},
        api_token="tok-123",
        session_cookie="c=1",
        password="pw",
    )
    log.warning("connect to amqp://guest:s3cret@mq:5672// failed; Bearer zzz123 refused")
    text = capture.getvalue()
    for secret in ("hunter2", "abc.def", "tok-123", "c=1", '"pw"', "s3cret", "zzz123"):
        assert secret not in text
    first, second = lines(capture)
    assert first["database"] == f"postgresql://app:{REDACTED}@db:5432/teamdesk"
    assert first["headers"] == {"Authorization": REDACTED, "Accept": "text/csv"}
    assert first["api_token"] == first["session_cookie"] == first["password"] == REDACTED
    assert second["event"] == "log" and second["level"] == "warn"
    assert second["message"] == (
        f"connect to amqp://guest:{REDACTED}@mq:5672// failed; Bearer {REDACTED} refused"
    )


def test_warn_level_hides_info(capture: io.StringIO) -> None:
    setup_logging("worker", "warn", capture)
    log = logging.getLogger("t")
    log_event(log, "task.started", task_id="T", run=0, attempt=1)
    log_event(log, "task.failed", logging.ERROR, task_id="T", run=0, attempt=3, exhausted=True)
    assert [line["event"] for line in lines(capture)] == ["task.failed"]


def test_silent_hides_everything(capture: io.StringIO) -> None:
    setup_logging("worker", "silent", capture)
    log_event(logging.getLogger("t"), "worker.fatal", logging.CRITICAL)
    assert capture.getvalue() == ""


def test_unknown_events_are_refused() -> None:
    with pytest.raises(ValueError):
        log_event(logging.getLogger("t"), "task.exploded")


def test_redact_text_leaves_plain_urls() -> None:
    assert redact_text("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_text("postgresql://u@h/db") == "postgresql://u@h/db"


class _ChannelThatLostItsConnection:
    no_ack_consumers = None

    def basic_ack(self, delivery_tag: object, multiple: bool = False) -> None:
        raise ConnectionError("Connection closed by server.")


def test_broker_hiccups_celery_and_kombu_call_critical_print_as_warnings(
    capture: io.StringIO,
) -> None:
    """An ack the lost connection could not send (kombu's own code path) and Celery's
    consumer restart throttle: the worker carries on after both, so neither is "fatal"."""
    setup_logging("worker", "info", capture)
    message = Message(channel=_ChannelThatLostItsConnection(), delivery_tag="7")
    message.ack_log_error(logging.getLogger("kombu.message"), (ConnectionError,))
    assert "crit('Frequent restarts detected: %r'" in inspect.getsource(Consumer.start)
    consumer_log = logging.getLogger("celery.worker.consumer.consumer")
    consumer_log.critical("Frequent restarts detected: %r", RuntimeError("5 in 1s"))
    logging.getLogger("t").critical("the worker cannot start")
    got = [(line["level"], str(line["message"]).split(",")[0]) for line in lines(capture)]
    assert got == [
        ("warn", "Couldn't ack '7'"),
        ("warn", "Frequent restarts detected: RuntimeError('5 in 1s')"),
        ("fatal", "the worker cannot start"),
    ]


def test_at_fatal_the_recoverable_ones_are_not_printed(capture: io.StringIO) -> None:
    setup_logging("worker", "fatal", capture)
    logging.getLogger("kombu.message").critical("Couldn't ack %r, reason:%r", "7", "gone")
    logging.getLogger("t").critical("the worker cannot start")
    assert [line["message"] for line in lines(capture)] == ["the worker cannot start"]
