"""What a task message must carry, and which execution a delivery is (docs/design.md,
"Lease").

Only the dispatcher publishes, and every message it sends is ``[task_id, run, stamp]``:
the run's id and number and its publish's stamp (the row's ``dispatched_at`` then). A
message that is anything else - sent by hand with ``celery call``, without a stamp, with
a wrong id or an extra argument - is refused before it touches the ledger: one warning
line, no traceback, nothing written. Its args are never echoed (they came from outside).

Each delivery's execution id is issued by the worker's main process as it hands the
message to its pool (worker/lost.py), in the request the pool process receives: should
that process die, the main process can name the lease it held (ledger/lease.py,
``report_lost``). A delivery run without a worker (a test calling the task) gets a new
one at its claim.
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


# The request field that carries the execution id the main process issued.
EXECUTION_ID_FIELD = "teamdesk_execution_id"


def issued_execution_id(request: Any) -> uuid.UUID | None:
    """The execution id the worker's main process issued for this delivery, if any."""
    value = getattr(request, EXECUTION_ID_FIELD, None)
    if not isinstance(value, str):
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        return None
