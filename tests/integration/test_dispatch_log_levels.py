"""A quiet dispatcher: at the default level (info) a beat logs its start (leader,
listening) and nothing per pass; a scan or fill with nothing of note, publishing due runs
included, is at debug."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.factories import World, add_tickets, task_row
from harness.waiting import wait_for
from ledger import service
from tests.support.dispatching import running_cluster


def dispatcher_records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    return [
        (str(getattr(r, "event", "")), r.levelno)
        for r in caplog.records
        if r.name == "teamdesk.dispatcher"
    ]


def test_passes_with_nothing_of_note_log_at_debug(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first export exists before the dispatcher starts, so its first scan publishes
    it; the second is created while it runs (published by a fill or a scan, whichever
    comes first). Neither publishing, nor the idle passes around them, logs at info."""
    app = make_app(scan_interval_s=0.1)
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 3)
        first = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    caplog.set_level(logging.DEBUG, logger="teamdesk.dispatcher")
    with running_cluster(app):
        scans = lambda: [e for e, _ in dispatcher_records(caplog) if e == "dispatcher.scan"]  # noqa: E731
        wait_for(lambda: task_row(engine, first)["status"] == "COMPLETED", what="COMPLETED")
        wait_for(lambda: len(scans()) >= 5, what="five scans")
        with engine.begin() as conn:
            second = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
        wait_for(lambda: task_row(engine, second)["status"] == "COMPLETED", what="COMPLETED")
        seen = len(scans())
        wait_for(lambda: len(scans()) >= seen + 3, what="three more idle scans")
    records = dispatcher_records(caplog)
    at_info = [(e, level) for e, level in records if level >= logging.INFO]
    assert at_info == [("dispatcher.leader", logging.INFO), ("dispatcher.listen", logging.INFO)]
    assert {level for e, level in records if e == "dispatcher.scan"} == {logging.DEBUG}
    published = [
        getattr(r, "dispatched", 0)
        for r in caplog.records
        if r.name == "teamdesk.dispatcher" and getattr(r, "event", "") == "dispatcher.scan"
    ]
    assert sum(published) == 2 and published[0] == 1  # the first pass, a scan, published
