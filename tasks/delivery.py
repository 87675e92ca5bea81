"""What a task message must carry, and what a delivery may take over (docs/design.md,
"Lease").

Only the dispatcher publishes, and every message it sends is ``[task_id, run, stamp]``:
the run's id and number and its publish's stamp (the row's ``dispatched_at`` then). A
message that is anything else - sent by hand with ``celery call``, without a stamp, with
a wrong id or an extra argument - is refused before it touches the ledger: one warning
line, no traceback, nothing written. Its args are never echoed (they came from outside).

A delivery may take over a RUNNING row only when the execution holding it is known to be
gone. Celery says so when it re-sends a message after the pool process running it was
lost (``Task.retry_on_worker_lost``: the re-send counts one more retry and is a new
message, not a redelivery); a message kombu restores after a broker reconnect, or a
duplicate, is neither, and its execution may be alive. The ledger's staleness rule covers
every other case (ledger/lease.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class MessageRefused(Exception):
    """A task message that is not ``[task_id, run, stamp]``; the text says what is wrong."""


@dataclass(frozen=True)
class Delivery:
    """A well-formed task message: which run, published with which stamp."""

    task_id: uuid.UUID
    run: int
    stamp: str  # as published (the marker's value)
    published: datetime  # the same stamp, as the ledger compares it


def parse(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Delivery:
    """The run a message names. Raises :class:`MessageRefused` for anything else."""
    if kwargs:
        raise MessageRefused("keyword arguments are not accepted")
    if len(args) != 3:
        raise MessageRefused(f"expected 3 arguments (task id, run, stamp), got {len(args)}")
    task_id, run, stamp = args
    try:
        parsed_id = uuid.UUID(str(task_id))
    except ValueError:
        raise MessageRefused("the task id is not a uuid") from None
    if not isinstance(run, int) or isinstance(run, bool) or run < 0:
        raise MessageRefused("the run is not a number of 0 or more")
    if not isinstance(stamp, str):
        raise MessageRefused("the message carries no publish stamp")
    try:
        published = datetime.fromisoformat(stamp)
    except ValueError:
        raise MessageRefused("the publish stamp is not a timestamp") from None
    if published.tzinfo is None:
        raise MessageRefused("the publish stamp has no time zone")
    return Delivery(parsed_id, run, stamp, published)


def may_take_over(request: Any) -> bool:
    """Is this delivery Celery's re-send after the pool process running the message was
    lost (then the execution holding the row is gone and it may take the row over)?"""
    delivery_info = getattr(request, "delivery_info", None) or {}
    return bool(getattr(request, "retries", 0)) and not delivery_info.get("redelivered")
