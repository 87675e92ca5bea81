"""The Celery app: settings that make the ledger's guarantees hold on the queue side
(docs/design.md, "Lease" and "Dispatch")."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from celery import Celery, signals
from kombu import Queue

from dispatcher.beat_host import beat_config
from tasks.broker_transport import use_for_redis_urls
from tasks.definitions import register
from tasks.names import EXPORTS_QUEUE, QUEUE_OF, REMINDERS_QUEUE
from teamdesk.config import Settings, get_settings, is_redis_url, is_sentinel_url
from teamdesk.logs import setup_logging
from worker import lifecycle
from worker.life import LifeStep
from worker.lost import PoolWatch
from worker.revokes import RevokeWatch

RESULT_EXPIRES = timedelta(days=1)
# No part of recovery (docs/design.md, "Dispatch", one clock): kombu compares it with each
# worker's clock, so a short one would let a worker whose clock runs ahead take every
# in-flight message.
VISIBILITY_TIMEOUT_S = 3600
SENTINEL_TIMEOUT_S = 2.0  # one question to one sentinel (which server is the master)


def sentinel_options(settings: Settings, url: str) -> dict[str, Any]:
    """Transport options for a URL that lists sentinels (empty for any other): the master's
    name, the sentinels' password, and a timeout, without which a frozen sentinel would
    hold a reconnect forever."""
    if not is_sentinel_url(url):
        return {}
    sentinels: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    }
    if settings.redis_sentinel_password:
        sentinels["password"] = settings.redis_sentinel_password
    return {"master_name": settings.redis_sentinel_master, "sentinel_kwargs": sentinels}


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from the configuration; nothing here is tuned per environment."""
    prefix = f"{settings.queue_prefix}:"
    broker_options: dict[str, Any] = {}
    if is_redis_url(settings.broker_url):
        # Two clusters, or two test runs, can share one Redis.
        broker_options["global_keyprefix"] = prefix
        broker_options["visibility_timeout"] = VISIBILITY_TIMEOUT_S
        broker_options.update(sentinel_options(settings, settings.broker_url))
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": broker_options,
        "broker_connection_retry_on_startup": True,
        # An error answer restarts the consumer instead of stopping the worker.
        "broker_channel_error_retry": True,
        # In-flight tasks go on when the broker is lost: Celery 6 flips this default.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "result_backend": settings.redis_url,
        "result_backend_transport_options": {
            "global_keyprefix": prefix,
            **sentinel_options(settings, settings.redis_url),
        },
        "result_expires": RESULT_EXPIRES,
        # JSON only: no pickle from the queue.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # A lost pool process is the run's failed attempt, reported by worker/lost.py.
        "task_acks_late": True,
        "task_reject_on_worker_lost": False,
        "worker_prefetch_multiplier": 1,
        # No task-sent events (they cost ~45% of a publish): Flower lists a task from its receipt.
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "event_exchange": f"{settings.queue_prefix}.celeryev",
        "control_exchange": f"{settings.queue_prefix}.control",
        "task_queues": (Queue(EXPORTS_QUEUE), Queue(REMINDERS_QUEUE)),
        "task_default_queue": EXPORTS_QUEUE,
        "task_routes": {name: {"queue": queue} for name, queue in QUEUE_OF.items()},
        "task_create_missing_queues": False,
        # We log in JSON ourselves (teamdesk.logs); Celery must not replace the handlers.
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings | None = None) -> Celery:
    """The composition root: the app with its tasks, the worker's liveness step and
    lifecycle receivers, and beat configured to run the dispatcher."""
    settings = settings or get_settings()
    use_for_redis_urls()
    app = Celery("teamdesk", set_as_current=False)
    app.conf.update(celery_config(settings))
    app.conf.update(beat_config(settings))
    register(app)
    app.steps["worker"].add(LifeStep)
    app.steps["worker"].add(PoolWatch)
    app.steps["worker"].add(RevokeWatch)
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
