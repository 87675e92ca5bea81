"""A worker's metrics (teamdesk/metrics.py, docs/design.md, "Observe"): multiprocess mode
and the endpoint, set up in the main process on ``celeryd_init`` before the pool forks
(without ``METRICS_PORT``, nothing), and each execution's kind and clock from
``task_prerun``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from tasks.names import TASK_OF_KIND
from teamdesk import metrics
from teamdesk.config import get_settings

log = logging.getLogger("teamdesk.worker")

KIND_OF_TASK = {task: kind for kind, task in TASK_OF_KIND.items()}


def _on_init(**_: Any) -> None:
    settings = get_settings()
    if not settings.metrics_port:
        return
    metrics.use_multiprocess()
    metrics.declare_task_families(list(TASK_OF_KIND))
    metrics.serve(settings.metrics_port, settings.metrics_host)
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)


def _on_prerun(sender: Any = None, **_: Any) -> None:
    name = getattr(sender, "name", None)
    metrics.task_began(KIND_OF_TASK.get(name or "", metrics.UNKNOWN_KIND))


def connect() -> None:
    """Called once per process by worker.lifecycle.connect."""
    signals.celeryd_init.connect(_on_init, weak=False)
    signals.task_prerun.connect(_on_prerun, weak=False)
