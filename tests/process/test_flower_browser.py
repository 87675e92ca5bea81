"""Export progress as a person sees it: Flower's task page rendered in headless Chromium.

A real ``celery -A tasks worker`` runs a 5,000-row export (10 batches of 500) while real
Flower (basic auth on) watches. The worker parks after reading each batch (the remote
gate ``export.after_read``), so at every stop the page's content is fixed: the last
progress event Flower can have is the previous batch's. At four stops the test renders
``/task/<task_id>-0`` in headless Chromium (``--dump-dom``, credentials in the URL, see
``tests/support/browser.py``) and reads the page's Status and Result fields:

- batch 1 parked: STARTED, no percent yet;
- then still STARTED, with the result ``20% (1000/5000 rows)``, ``50% (2500/5000 rows)``,
  ``90% (4500/5000 rows)`` — the percent shown moves up (progress events never change
  the state: tasks/names.py, ``PROGRESS_EVENT``);
- after the last release: SUCCESS with the result ``5000 rows``.

At 50% it also takes a 1280x900 screenshot (``flower-progress.png`` in the test's tmp
dir; with ``TEAMDESK_FLOWER_SCREENSHOT=docs/flower-progress.png`` it is copied there, which
is how docs/observability.md's picture is made). The same URL without credentials renders no task.

Ordering comes from the gates; the only waits are for Flower to catch up with an event the
worker already sent (a deadline detects one that never arrives).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from harness.factories import World, add_tickets, task_row
from harness.processes import (
    ROOT,
    Proc,
    celery_argv,
    cluster,
    free_port,
    settings_env,
    worker_argv,
)
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from ledger import service
from tasks import queueing
from tasks.celery_app import create_app
from teamdesk.config import Settings
from tests.support.browser import (
    Chromium,
    RenderedPage,
    chromium_for_test,
    png_size,
    redact,
    with_credentials,
)
from tests.support.flower import flower_sees_worker
from tests.support.queues import send_message

pytestmark = pytest.mark.slow

USER, PASSWORD = "admin", "secret"
ROWS, BATCH = 5000, 500
BATCHES = ROWS // BATCH
SCREENSHOT_AT = 6  # parked after reading batch 6: the page shows 50% (2500/5000 rows)
RENDER_AT = (1, 3, SCREENSHOT_AT, BATCHES)
WINDOW = (1280, 900)
SCREENSHOT_ENV = "TEAMDESK_FLOWER_SCREENSHOT"
PROGRESS_RE = re.compile(r"^(\d+)% \((\d+)/(\d+) rows\)$")


def shown_percent(page: RenderedPage) -> int | None:
    match = PROGRESS_RE.match(page.field("Result") or "")
    return int(match.group(1)) if match else None


def shows_progress_of(batch: int) -> tuple[Callable[[RenderedPage], bool], str]:
    """When the page has caught up with the worker parked after reading ``batch``: the
    newest progress event it sent is batch-1's (none yet at batch 1)."""
    if batch == 1:
        return (lambda page: page.field("Status") == "STARTED"), "STARTED"
    expected = (batch - 1) * 100 // BATCHES
    return (lambda page: (shown_percent(page) or 0) >= expected), f"{expected}%"


def summary(page: RenderedPage) -> str:
    return f"Status={page.field('Status')!r} Result={page.field('Result')!r}"


def render_until(
    browser: Chromium,
    url: str,
    ready: Callable[[RenderedPage], bool],
    what: str,
    timeout: float = 30.0,
) -> RenderedPage:
    """Render ``url`` until the page satisfies ``ready`` (Flower caught up), or fail."""
    deadline = time.monotonic() + timeout
    page: RenderedPage | None = None
    while True:
        page = RenderedPage(browser.dump_dom(url, window=WINDOW))
        if ready(page):
            return page
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{redact(url)} never showed {what} within {timeout} s; last render: {page!r}"
            )
        time.sleep(0.2)  # polling the render for Flower to catch up, bounded by the deadline


@pytest.fixture
def browser(tmp_path: Path) -> Chromium:
    return chromium_for_test(tmp_path / "chromium")


def test_flower_task_page_shows_export_progress_in_a_browser(
    engine: sa.Engine,
    world: World,
    settings: Settings,
    redis_client: redis.Redis,
    browser: Chromium,
    tmp_path: Path,
) -> None:
    assert settings.export_batch_size == BATCH
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, ROWS)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    message = queueing.message_id(task_id, 0)
    gate = RemoteGate(redis_client, settings.queue_prefix, "export.after_read")
    port = free_port()
    page_url = f"http://127.0.0.1:{port}/task/{message}"
    authed_url = with_credentials(page_url, USER, PASSWORD)
    env = settings_env(
        settings,
        TEAMDESK_TEST_HOOKS="harness.remote_gates",
        TEAMDESK_TEST_GATES="export.after_read",
    )
    pages: dict[int, RenderedPage] = {}
    screenshot = tmp_path / "flower-progress.png"
    with cluster(tmp_path) as procs:
        worker = Proc("worker", worker_argv("w1", concurrency=1), env, tmp_path).start()
        flower = Proc(
            "flower",
            celery_argv(
                "flower", "--address=127.0.0.1", f"--port={port}", f"--basic-auth={USER}:{PASSWORD}"
            ),
            env,
            tmp_path,
        ).start()
        procs += [worker, flower]
        worker.wait_event("worker.started")
        wait_for(lambda: flower_sees_worker(port), timeout=30, what="Flower to see the worker")
        app = create_app(settings)
        try:
            send_message(app, task_id, 0, "EXPORT")
            for batch in range(1, BATCHES + 1):
                reached = gate.wait_reached()
                assert (reached["done"], reached["total"]) == (batch * BATCH, ROWS)
                if batch in RENDER_AT:
                    pages[batch] = render_until(
                        browser, authed_url, *shows_progress_of(batch), timeout=30
                    )
                    print(f"parked after batch {batch}: {summary(pages[batch])}")
                    if batch == SCREENSHOT_AT:
                        browser.screenshot(authed_url, screenshot, window=WINDOW)
                gate.release()
            final = render_until(
                browser, authed_url, lambda p: p.field("Status") == "SUCCESS", "SUCCESS"
            )
            print(f"after the last release: {summary(final)}")
        finally:
            gate.release(times=20)
            app.close()
        anonymous = RenderedPage(browser.dump_dom(page_url, window=WINDOW))

    # The task page was really rendered (authenticated), for this task.
    for page in [*pages.values(), final]:
        assert page.title.startswith(f"teamdesk.export {message[:8]}"), page
        assert page.field("Name") == "teamdesk.export", page
        assert message in (page.field("UUID") or ""), page
    # Before any progress event: started, no percent.
    assert pages[1].field("Status") == "STARTED", pages[1]
    assert shown_percent(pages[1]) is None, pages[1]
    # Then the progress text, the state still STARTED, and it moves up.
    progress = {batch: pages[batch] for batch in RENDER_AT if batch > 1}
    for batch, page in progress.items():
        done = (batch - 1) * BATCH
        assert page.field("Status") == "STARTED", page
        assert page.field("Result") == f"{done * 100 // ROWS}% ({done}/{ROWS} rows)", page
    percents = [shown_percent(page) or 0 for page in progress.values()]
    assert percents == [20, 50, 90]
    assert all(earlier < later for earlier, later in itertools.pairwise(percents))
    # Finally SUCCESS with the export's summary.
    assert "5000 rows" in (final.field("Result") or ""), final
    assert shown_percent(final) is None, final
    # Without credentials Flower answers 401 and Chromium renders no task.
    assert anonymous.field("Status") is None, anonymous
    assert message not in anonymous.html

    assert png_size(screenshot) == WINDOW
    target = os.environ.get(SCREENSHOT_ENV)
    if target:
        path = Path(target) if Path(target).is_absolute() else ROOT / target
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, path)

    row = task_row(engine, task_id)
    assert (row["status"], row["progress"], row["result_summary"]) == (
        "COMPLETED",
        100,
        "5000 rows",
    )
