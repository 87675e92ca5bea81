"""What beat sends, and how exactly one beat is active.

Schedule: the dispatcher scan (``teamdesk.scan``, SPEC §7 steps 1-4) every
``SCAN_INTERVAL_S``, and the purge of expired CSVs (``teamdesk.purge``, step 5) every
``PURGE_INTERVAL_S``. Both go to the ``maintenance`` queue. A scan message that waited
longer than :func:`scan_expires_s` expires unrun, so a busy cluster runs at most a few
stale scans, not hours of them, when a worker frees up. The bound is generous (at least
30 s) because beat stamps the expiry with its clock and the worker checks it with its
own: a tight bound plus a little clock skew would drop every scan.

Heartbeat renewal is deliberately NOT scheduled here. Each worker process renews its own
member from a bootstep timer in its main process (``worker/steps.py``): a beat-scheduled
task runs on whichever worker takes it, so it cannot renew every worker, and a kombu
Broadcast queue on the Redis transport delivered nothing when tried (see the celery
notes, §4). Renewal therefore keeps working while beat is down.

Exactly one active beat: celery-redbeat's lock. Beat runs with
``redbeat.RedBeatScheduler`` (set here, so ``celery -A tasks beat`` needs no ``-S``). At
start a beat takes the Redis lock ``<QUEUE_PREFIX>:redbeat::lock`` and extends it on
every tick; a second beat blocks on the lock, sending nothing, and takes over when the
first releases it (SIGTERM: within one loop interval) or when it expires (SIGKILL, a
frozen host: within ``beat_lock_timeout_s``, 15 s with the defaults). Why not "just run
one": the scans are safe to overlap, so a second beat would not be wrong, only doubled
work; but with one beat and no standby, a beat that dies or a node that stops answering
means nothing is dispatched or recovered until the orchestrator notices, which for a lost
node is minutes. A standby makes that seconds, and the lock also guards against an
accidental second beat (``--scale``, a worker started with ``-B``). The schedule's state
(each entry's last run) lives in Redis too, so a standby continues it and no schedule
file is needed (``--schedule`` is ignored). The lock and the entries live on
``REDIS_URL`` (the Redis that is never replaced by RabbitMQ), under the queue prefix.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from celery import Celery

from teamdesk.config import Settings

# The maintenance tasks' names and queue; tasks.celery_app routes them.
SCAN_TASK = "teamdesk.scan"
PURGE_TASK = "teamdesk.purge"
MAINTENANCE_QUEUE = "maintenance"

PURGE_INTERVAL_S = 60.0  # CSVs are kept 24 h; a minute late is nothing
SCAN_EXPIRES_INTERVALS = 10  # an unstarted scan message is dropped after this many intervals
MIN_SCAN_EXPIRES_S = 30.0  # ... but never sooner (clock skew between beat and workers)
BEAT_MAX_LOOP_S = 5.0  # beat wakes at least this often (it extends the lock each time)
LOCK_TIMEOUT_LOOPS = 5  # the lock survives this many missed ticks
MIN_LOCK_TIMEOUT_S = 2  # redbeat extends the lock by whole seconds
REDIS_TIMEOUT_S = 5.0
SCHEDULER = "redbeat.RedBeatScheduler"


def build_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The beat schedule (``app.conf.beat_schedule``)."""
    return {
        "dispatcher-scan": {
            "task": SCAN_TASK,
            "schedule": timedelta(seconds=settings.scan_interval_s),
            "options": {"queue": MAINTENANCE_QUEUE, "expires": scan_expires_s(settings)},
        },
        "purge-expired-csv": {
            "task": PURGE_TASK,
            "schedule": timedelta(seconds=PURGE_INTERVAL_S),
            "options": {"queue": MAINTENANCE_QUEUE, "expires": PURGE_INTERVAL_S},
        },
    }


def scan_expires_s(settings: Settings) -> float:
    return max(SCAN_EXPIRES_INTERVALS * settings.scan_interval_s, MIN_SCAN_EXPIRES_S)


def beat_loop_s(settings: Settings) -> float:
    return min(settings.scan_interval_s, BEAT_MAX_LOOP_S)


def beat_lock_timeout_s(settings: Settings) -> int:
    """How long the lock outlives its beat: a standby takes over at most this late."""
    return max(MIN_LOCK_TIMEOUT_S, math.ceil(LOCK_TIMEOUT_LOOPS * beat_loop_s(settings)))


def lock_key(settings: Settings) -> str:
    return f"{redbeat_prefix(settings)}:lock"


def redbeat_prefix(settings: Settings) -> str:
    return f"{settings.queue_prefix}:redbeat:"


def beat_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for beat: the schedule and the redbeat lock."""
    return {
        "beat_schedule": build_schedule(settings),
        "beat_scheduler": SCHEDULER,
        "beat_max_loop_interval": beat_loop_s(settings),
        "redbeat_redis_url": settings.redis_url,
        "redbeat_redis_options": {
            "socket_timeout": REDIS_TIMEOUT_S,
            "socket_connect_timeout": REDIS_TIMEOUT_S,
        },
        "redbeat_key_prefix": redbeat_prefix(settings),
        "redbeat_lock_key": lock_key(settings),
        "redbeat_lock_timeout": beat_lock_timeout_s(settings),
    }


def install(app: Celery, settings: Settings) -> None:
    """Register the maintenance tasks and the schedule on ``app`` (idempotent).

    Every process needs the tasks (workers run them); the schedule is read only by beat.
    """
    from dispatcher.beat_tasks import register

    register(app)
    app.conf.update(beat_config(settings))
