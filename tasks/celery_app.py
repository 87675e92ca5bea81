"""The Celery app: settings that make the ledger's guarantees hold on the queue side."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from celery import Celery, signals
from kombu import Queue

from beat_schedule import MAINTENANCE_QUEUE, PURGE_TASK, SCAN_TASK
from teamdesk.config import Settings, get_settings
from teamdesk.logs import setup_logging

EXPORT_TASK = "teamdesk.export"
REMINDER_TASK = "teamdesk.reminder"
EXPORTS_QUEUE = "exports"
REMINDERS_QUEUE = "reminders"
# The dispatcher's scan and purge go to MAINTENANCE_QUEUE: a backlog of exports must not
# delay the scan that recovers them (every worker consumes all three queues by default).
QUEUE_OF = {EXPORT_TASK: EXPORTS_QUEUE, REMINDER_TASK: REMINDERS_QUEUE}
ROUTES = {**QUEUE_OF, SCAN_TASK: MAINTENANCE_QUEUE, PURGE_TASK: MAINTENANCE_QUEUE}
TASK_OF_KIND = {"EXPORT": EXPORT_TASK, "REMINDER": REMINDER_TASK}

RESULT_EXPIRES = timedelta(days=1)


def _is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from SPEC §12; nothing here is tuned per environment."""
    prefix = f"{settings.queue_prefix}:"
    broker_options: dict[str, Any] = {}
    if _is_redis(settings.broker_url):
        # Every broker key (queues, unacked messages, their index) lives under the prefix,
        # so two clusters, or two test runs, can share one Redis.
        broker_options["global_keyprefix"] = prefix
        # A delivered message another consumer may take once its holder stopped renewing
        # it (worker/liveness.py renews it while the task runs); swept every few seconds.
        broker_options["visibility_timeout"] = settings.stale_after_s
        broker_options["unacked_restore_interval"] = max(1.0, min(10.0, settings.stale_after_s / 4))
        broker_options["unacked_restore_throttle"] = 1
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": broker_options,
        "broker_connection_retry_on_startup": True,
        "result_backend": settings.redis_url,
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "result_expires": RESULT_EXPIRES,
        # JSON only: no pickle from the queue.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # A message is acknowledged after the task returns; a lost worker process sends it
        # again (Task.retry_on_worker_lost below, bounded by the same attempt budget).
        "task_acks_late": True,
        "task_reject_on_worker_lost": False,
        "worker_prefetch_multiplier": 1,
        # Flower builds its view from events only.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "event_exchange": f"{settings.queue_prefix}.celeryev",
        "control_exchange": f"{settings.queue_prefix}.control",
        "task_queues": (Queue(EXPORTS_QUEUE), Queue(REMINDERS_QUEUE), Queue(MAINTENANCE_QUEUE)),
        "task_default_queue": EXPORTS_QUEUE,
        "task_routes": {name: {"queue": queue} for name, queue in ROUTES.items()},
        "task_create_missing_queues": False,
        # We log in JSON ourselves (teamdesk.logs); Celery must not replace the handlers.
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("teamdesk", set_as_current=False)
    app.conf.update(celery_config(settings))
    from beat_schedule import install as install_beat
    from tasks.definitions import register
    from worker import lifecycle
    from worker.steps import LivenessStep

    register(app, settings)
    install_beat(app, settings)
    app.steps["worker"].add(LivenessStep)
    lifecycle.connect()
    return app


def service_name() -> str:
    for name in ("worker", "beat", "flower"):
        if name in sys.argv:
            return name
    return "celery"


@signals.setup_logging.connect
def _json_logging(loglevel: Any = None, **_: Any) -> None:
    """Any receiver here stops Celery from configuring logging; we install our JSON setup."""
    setup_logging(service_name(), get_settings().log_level)
