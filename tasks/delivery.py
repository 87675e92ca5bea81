"""What a task message must carry, ``[task_id, run, stamp]``, and which execution a delivery
is (docs/design.md, "Lease"). A refusal never echoes the args (they came from outside); a
delivery run without a worker (a test calling the task) gets its execution id at the claim.
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
    published: datetime  # the publish's stamp, as the ledger compares it


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
    return Delivery(parsed_id, run, published)


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
