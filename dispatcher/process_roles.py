"""Which process roles the cluster has now (a leading dispatcher, live worker processes per
queue), read from Redis alone, never the broker (docs/design.md, "Dispatch").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from dispatcher.leader import leader_key
from tasks.names import TASK_QUEUES
from teamdesk.heartbeat import slots_by_queue


@dataclass(frozen=True)
class ProcessRoles:
    """``dispatcher``: a dispatcher holds the leader lock. ``consumers``: live worker
    processes (pool slots) per task queue."""

    dispatcher: bool
    consumers: dict[str, int] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        gone = [] if self.dispatcher else ["dispatcher"]
        return gone + [f"{q} worker" for q in TASK_QUEUES if self.consumers.get(q, 0) == 0]

    def as_dict(self) -> dict[str, Any]:
        consumers = {q: self.consumers.get(q, 0) for q in TASK_QUEUES}
        return {"dispatcher": self.dispatcher, "consumers": consumers, "missing": self.missing}


def read_process_roles(client: redis.Redis, prefix: str) -> ProcessRoles:
    """Raises ``redis.RedisError`` when Redis cannot be read."""
    leading = bool(client.exists(leader_key(prefix)))
    return ProcessRoles(leading, slots_by_queue(client, prefix))
