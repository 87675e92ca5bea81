"""Named points in the task code where tests attach gates (or inject a failure), to force
an interleaving without sleeping (docs/design.md, "Tests"). Production installs nothing,
so :func:`fire` is a dictionary lookup that finds no callbacks.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Hook = Callable[..., None]

_hooks: dict[str, list[Hook]] = {}
_lock = threading.Lock()

POINTS = frozenset(
    {
        "task.before_claim",  # a message arrived; the claim not yet sent
        "task.claimed",  # after the claim committed
        "task.before_failure_report",  # an attempt failed; the ledger not yet told
        "export.after_read",  # a batch was read, its progress not yet written
        "export.before_result_write",  # the final permission check passed
        "reminder.after_lease_read",  # inside the transaction, lease seen, nothing written
        "reminder.after_event_insert",  # side effects and completion written, not committed
        "queue.failure_callback",  # Celery's task_failure signal, before it logs
        "heartbeat.before_renewal",  # checked it is not stopping; the Lua call not yet sent
        "dispatcher.before_publish",  # runs stamped and committed; their messages not yet sent
        "watchdog.before_cancel",  # a watch's deadline passed; its cancel not yet decided
        "cli.after_commit",  # a CLI creation or retry committed; its answer not yet printed
    }
)


def fire(point: str, **context: Any) -> None:
    for hook in _hooks.get(point, ()):
        hook(**context)


def install(point: str, hook: Hook) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}")
    with _lock:
        _hooks.setdefault(point, []).append(hook)


@contextmanager
def installed(point: str, hook: Hook) -> Iterator[None]:
    install(point, hook)
    try:
        yield
    finally:
        with _lock:
            _hooks[point].remove(hook)
            if not _hooks[point]:
                del _hooks[point]


TEST_HOOKS_ENV = "TEAMDESK_TEST_HOOKS"


def load_from_env() -> None:
    """Test seam for subprocess workers: import the module named by TEAMDESK_TEST_HOOKS
    (it installs its own hooks). Unset in production, where this does nothing."""

    name = os.environ.get(TEST_HOOKS_ENV)
    if name:
        importlib.import_module(name)
