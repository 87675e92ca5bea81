"""One JSON log setup for every process (docs/design.md, "Logs").

Our code logs :data:`EVENTS` through :func:`log_event`; a library's line keeps its text
under ``message`` with ``event`` ``log``.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from teamdesk import metrics, tracing
from teamdesk.redaction import REDACTED, redact, redact_text

__all__ = ["EVENTS", "LEVELS", "REDACTED", "log_event", "redact", "redact_text", "setup_logging"]

EVENTS = frozenset(
    {
        "worker.started",
        "worker.stopping",
        "worker.stopped",
        "worker.shutdown_timeout",
        "worker.consuming_paused",
        "worker.consuming_resumed",
        "worker.fatal",
        "task.started",
        "task.attempt_failed",
        "task.completed",
        "task.skipped",
        "task.refused",
        "task.revoked",
        "task.failed",
        "task.lease_lost",
        "task.cancelled",
        "task.stalled",
        "task.process_lost",
        "dispatcher.failed",
        "dispatcher.recovered",
        "dispatcher.scan",
        "dispatcher.leader",
        "dispatcher.listen",
        "dispatcher.no_consumers",
        "dispatcher.store_failed",
        "dispatcher.objects_purged",
        "heartbeat.failed",
    }
)

TRACE = 5
SILENT = logging.CRITICAL + 10
logging.addLevelName(TRACE, "TRACE")

LEVELS = {
    "fatal": logging.CRITICAL,
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": TRACE,
    "silent": SILENT,
}
_LEVEL_NAMES = {
    logging.CRITICAL: "fatal",
    logging.ERROR: "error",
    logging.WARNING: "warn",
    logging.INFO: "info",
    logging.DEBUG: "debug",
    TRACE: "trace",
}

_RESERVED = ("time", "level", "event", "service", "pid", "trace_id", "span_id")

# They would print SQL with its parameters and rows: never below WARNING, whatever LOG_LEVEL.
NEVER_BELOW_WARNING = ("sqlalchemy.engine", "sqlalchemy.pool", "sqlalchemy.orm")


class TeamdeskJsonFormatter(JsonFormatter):
    def __init__(self, service: str) -> None:
        super().__init__("{message}", style="{")
        self.service = service

    def add_fields(
        self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_record, record, message_dict)
        created = datetime.fromtimestamp(record.created, tz=UTC)
        event = getattr(record, "event", None)
        ordered = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": _LEVEL_NAMES.get(record.levelno, record.levelname.lower()),
            "event": event or "log",
            "service": self.service,
            "pid": os.getpid(),
            **tracing.log_fields(),  # trace_id, span_id while a span is active
        }
        if event:
            log_record.pop("message", None)
        log_record.pop("event", None)
        # uvicorn's copy of some lines with terminal colour escapes (its own "Started
        # server process" comes before any filter of ours could be installed).
        log_record.pop("color_message", None)
        rest = dict(log_record)
        log_record.clear()
        log_record.update(ordered)
        log_record.update(rest)

    def process_log_record(self, log_record: dict[str, Any]) -> dict[str, Any]:
        return {k: (v if k in _RESERVED else redact(v, k)) for k, v in log_record.items()}


_configured_service: str | None = None


# Logged at CRITICAL while the broker is down, and recovered from: printed as warnings.
RECOVERABLE_CRITICAL = (
    "Frequent restarts detected: %r",  # celery.worker.consumer.consumer
    "Couldn't ack %r, reason:%r",  # kombu.message
)


class _RecoverableAsWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.CRITICAL and record.msg in RECOVERABLE_CRITICAL:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return logging.getLogger().isEnabledFor(logging.WARNING)
        return True


# celery.app.trace.LOG_IGNORED, for a cancelled run: a cancel is not an error, so the
# line drops the traceback Celery passes in the record's ``data``.
CELERY_IGNORED = "Task %(name)s[%(id)s] %(description)s"


class _IgnoredWithoutTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if record.msg == CELERY_IGNORED and isinstance(data, dict):
            record.data = {k: v for k, v in data.items() if k != "traceback"}
        return True


class _JsonHandler(logging.StreamHandler):
    """Ours, so a second setup replaces it and leaves other handlers (pytest's) alone."""


def setup_logging(service: str, level: str = "info", stream: Any = None) -> None:
    """Install the JSON handler on the root logger, replacing one installed earlier."""
    global _configured_service
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _JsonHandler):
            root.removeHandler(old)
    handler = _JsonHandler(stream or sys.stderr)
    handler.setFormatter(TeamdeskJsonFormatter(service))
    handler.addFilter(_RecoverableAsWarning())
    handler.addFilter(_IgnoredWithoutTraceback())
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    logging.captureWarnings(True)  # Python warnings become JSON lines too
    # Libraries chatter at INFO: WARNING unless the operator asked for debug or trace.
    quiet = logging.WARNING if LEVELS[level] > logging.DEBUG else LEVELS[level]
    for name in ("kombu", "amqp", "urllib3", "alembic", "botocore", "boto3", "s3transfer"):
        logging.getLogger(name).setLevel(max(quiet, LEVELS[level]))
    for name in NEVER_BELOW_WARNING:
        logging.getLogger(name).setLevel(max(logging.WARNING, LEVELS[level]))
    _configured_service = service


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event of :data:`EVENTS`; ``fields`` become top-level JSON keys. The event
    is counted for the metrics whatever the level (teamdesk/metrics.py)."""
    if event not in EVENTS:
        raise ValueError(f"unknown log event {event!r}")
    metrics.on_event(event, fields)
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"event": event, **fields})
