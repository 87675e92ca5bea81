"""When the dispatcher may read a missing heartbeat as a dead holder (docs/design.md,
"Heartbeats"): only while the heartbeat record has been kept unbroken for more than one
``HEARTBEAT_TTL_S``. An emptied Redis - FLUSHALL, maxmemory eviction, a failover to a
replica that holds another server's record - is "cannot tell", never "dead".

Each fault hits a dedicated ``redis-server`` holding the heartbeats (``REDIS_URL``); the
broker stays on the shared Redis under the test's prefix. An in-process worker runs a
live export, parked at a gate; its next heartbeat renewal is parked at another gate while
the fault strikes, so the scan that follows sees Redis exactly as the fault left it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from dispatcher.scan import ScanCounts, read_heartbeats, run_once
from harness.factories import World, add_tickets, audit_trail, task_row
from harness.waiting import wait_for
from ledger import service
from teamdesk import config, hooks
from teamdesk.config import Settings
from teamdesk.heartbeat import Heartbeat, holders_key
from tests.support.dispatch_scan import running_row
from tests.support.gates import Gate
from tests.support.queues import send_message
from tests.support.redis_server import dedicated_redis
from tests.support.workers import running_worker

TTL_S = 1.0
FILLER_BYTES = 4 * 1024 * 1024  # a key without a TTL, far larger than every heartbeat key


def flush_all(client: redis.Redis) -> None:
    client.flushall()


def evict_volatile_keys(client: redis.Redis) -> None:
    """maxmemory with ``volatile-lru``: Redis evicts keys that carry a TTL, and every
    heartbeat key does. A large key without a TTL fills the memory, maxmemory drops below
    what is used, and Redis evicts every volatile key; then the squeeze is lifted."""
    client.config_set("maxmemory-policy", "volatile-lru")
    client.set("filler", "x" * FILLER_BYTES)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used - FILLER_BYTES // 2)
    try:
        wait_for(
            lambda: client.info("keyspace").get("db0", {}).get("expires", 0) == 0,
            what="every key with a TTL to be evicted",
        )
    finally:
        client.config_set("maxmemory", 0)
        client.delete("filler")


def scan_keeping(
    app: Celery, s: Settings, engine: sa.Engine, task_id: uuid.UUID, execution: Any
) -> ScanCounts:
    """One scan; the live run must still be its execution's after it."""
    counts = run_once(app, settings=s)
    row = task_row(engine, task_id)
    assert (row["status"], row["execution_id"]) == ("RUNNING", execution), counts.summary()
    return counts


@contextmanager
def live_export(engine: sa.Engine, world: World, app: Celery) -> Iterator[uuid.UUID]:
    """An export running on an in-process worker, parked after its first read; it must
    complete as the same execution once released."""
    with engine.begin() as conn:
        add_tickets(conn, world.team_id, world.customer_id, 700)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    running = Gate("the live export, after its first read")
    with (
        hooks.installed("export.after_read", running.hook()),
        running_worker(app, queues=("exports",)),
    ):
        try:
            send_message(app, task_id, 0, "EXPORT")
            running.wait_reached()
            yield task_id
        finally:
            running.release()
        wait_for(lambda: task_row(engine, task_id)["status"] == "COMPLETED", what="COMPLETED")


@pytest.mark.parametrize("fault", [flush_all, evict_volatile_keys], ids=["flushall", "eviction"])
def test_an_emptied_redis_takes_no_live_lease_and_a_dead_holder_only_once_trusted(
    engine: sa.Engine,
    world: World,
    make_app: Callable[..., Celery],
    fault: Callable[[redis.Redis], None],
) -> None:
    with dedicated_redis() as server:
        app = make_app(redis_url=server.url, heartbeat_ttl_s=TTL_S)
        s = config.get_settings()
        client = server.client()
        with live_export(engine, world, app) as live_id:
            execution = task_row(engine, live_id)["execution_id"]
            wait_for(
                lambda: scan_keeping(app, s, engine, live_id, execution).heartbeat_rule,
                what="the heartbeats to be trusted",
            )
            # A reminder (nobody consumes reminders here) held by a process that is gone.
            dead_id = running_row(
                engine, world, holder=f"test-host/{uuid.uuid4()}", kind="REMINDER"
            )
            dead_before = task_row(engine, dead_id)
            renewal = Gate("the worker's next heartbeat renewal")
            with hooks.installed("heartbeat.before_renewal", renewal.hook()):
                try:
                    renewal.wait_reached()
                    fault(client)

                    counts = scan_keeping(app, s, engine, live_id, execution)

                    assert (counts.heartbeat_rule, counts.recovered) == (False, 0)
                    assert task_row(engine, dead_id) == dead_before  # cannot tell: not dead
                finally:
                    renewal.release()

            # The worker registers again; once the record is one TTL old, the dead holder's
            # run is taken back and the live one still is not.
            wait_for(
                lambda: scan_keeping(app, s, engine, live_id, execution).recovered,
                what="the dead holder's run to be recovered",
            )
        dead = task_row(engine, dead_id)
        assert (dead["status"], dead["recoveries"], dead["lease_holder"]) == ("WAITING", 1, None)
        claimed = str(dead_before["execution_id"])
        assert audit_trail(engine, dead_id) == [("CLAIM", claimed), ("RECOVER", claimed)]
    done = task_row(engine, live_id)
    assert (done["status"], done["recoveries"], done["result_summary"]) == (
        "COMPLETED",
        0,
        "700 rows",
    )
    assert audit_trail(engine, live_id) == [("CLAIM", str(execution)), ("COMPLETE", str(execution))]


def test_a_replica_holding_the_old_primarys_record_is_not_trusted(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    """A failover to a replica: the replica holds the primary's record (copied here with
    DUMP/RESTORE, as replication would), however far behind. It is not trusted until a
    renewal on the new server started a record of its own and one TTL passed."""
    beat = Heartbeat(redis_client, queue_prefix, "host-a", TTL_S)
    assert beat.renew()
    wait_for(lambda: read_heartbeats(redis_client, queue_prefix, TTL_S).trusted, what="trust")
    assert beat.renew()  # its member is live in what the replica receives
    key = holders_key(queue_prefix)
    dumped = redis_client.execute_command("DUMP", key, NEVER_DECODE=True)
    try:
        with dedicated_redis() as server:
            replica = server.client()
            replica.restore(key, 0, dumped)

            view = read_heartbeats(replica, queue_prefix, TTL_S)
            assert view.live == {beat.member} and view.trusted is False

            promoted = Heartbeat(replica, queue_prefix, "host-a", TTL_S)
            assert promoted.renew()
            assert read_heartbeats(replica, queue_prefix, TTL_S).trusted is False
            wait_for(
                lambda: read_heartbeats(replica, queue_prefix, TTL_S).trusted,
                what="the new server's record to be one TTL old",
            )
            assert promoted.renew()
            assert read_heartbeats(replica, queue_prefix, TTL_S).live == {promoted.member}
    finally:
        beat.remove()
