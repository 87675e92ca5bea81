"""What the cluster lacks, in words: ``/api/workers/health``'s problems, ``health --cluster``
and a waiting task's ``waiting_reason`` (docs/design.md, "Dispatch").

Process roles come from Redis only (dispatcher/process_roles.py); no database or broker is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import redis

from dispatcher.process_roles import ProcessRoles, read_process_roles
from tasks.names import QUEUE_OF_KIND, TASK_QUEUES

MSG_NO_DISPATCHER = "no dispatcher is running (start one: celery -A tasks beat)"
MSG_NO_WORKER = "no worker consumes {queue}"
MSG_NO_REDIS = "Redis does not answer: nothing can be published or run"
EXPLAIN_AFTER_S = 5  # ready and not started after this long: a waiting_reason


def no_worker(queue: str) -> str:
    return MSG_NO_WORKER.format(queue=queue)


def _tasks(count: int, cap: int | None) -> str:
    more = "+" if cap is not None and count >= cap else ""
    return f"{count}{more} task{'' if count == 1 else 's'} waiting"


def problems(
    roles: ProcessRoles, waiting: Mapping[str, int] | None = None, cap: int | None = None
) -> list[str]:
    """One sentence per missing role: the dispatcher first, then each task queue without a
    live worker, with how many ready tasks wait for it when ``waiting`` (per queue) says."""
    found = [] if roles.dispatcher else [MSG_NO_DISPATCHER]
    for queue in TASK_QUEUES:
        if roles.consumers.get(queue, 0) == 0:
            count = (waiting or {}).get(queue, 0)
            found.append(no_worker(queue) + (f" ({_tasks(count, cap)})" if count else ""))
    return found


def waiting_reason(kind: str, roles: ProcessRoles | None) -> str | None:
    """What holds a ready WAITING task of ``kind`` back, or None when nothing is missing
    (it is in line). ``roles`` None: Redis could not be read."""
    if roles is None:
        return MSG_NO_REDIS
    queue = QUEUE_OF_KIND[kind]
    if roles.consumers.get(queue, 0) == 0:
        return no_worker(queue)
    return None if roles.dispatcher else MSG_NO_DISPATCHER


def is_late(view: Mapping[str, Any]) -> bool:
    """Whether a task has been ready and waiting for :data:`EXPLAIN_AFTER_S` or more
    (``waiting_s`` is measured by the database's clock)."""
    waiting_s = view.get("waiting_s")
    return waiting_s is not None and waiting_s >= EXPLAIN_AFTER_S


def explain_waiting(views: list[dict[str, Any]], read: Callable[[], ProcessRoles | None]) -> None:
    """Set each view's ``waiting_reason``: why a late task (see :func:`is_late`) has not
    started, else None. ``read`` (the roles, None when Redis cannot be read) is called at
    most once, and only when some task is late."""
    roles: list[ProcessRoles | None] = []
    for view in views:
        reason = None
        if is_late(view):
            if not roles:
                roles.append(read())
            reason = waiting_reason(view["kind"], roles[0])
        view["waiting_reason"] = reason


def process_roles_or_none(client: redis.Redis, prefix: str) -> ProcessRoles | None:
    try:
        return read_process_roles(client, prefix)
    except redis.RedisError:
        return None


def waiting_line(view: Mapping[str, Any], step_s: int = 1) -> str | None:
    """``waiting 60 s: no worker consumes exports`` for a late task (its seconds rounded
    down to ``step_s``), else None."""
    if not is_late(view):
        return None
    seconds = int(view["waiting_s"]) // step_s * step_s
    reason = view.get("waiting_reason")
    return f"waiting {seconds} s" + (f": {reason}" if reason else "")
