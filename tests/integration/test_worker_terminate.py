"""How a worker's liveness ends when Celery terminates it rather than stopping it: a cold
shutdown, and every ``celery.contrib.testing`` worker's end (``should_terminate = 0``).
Celery's blueprint then calls each step's ``terminate``, not its ``stop``; the liveness
step must end the same way on both. Its renewal thread once ran on past the worker's
end: it renewed a heartbeat for a worker that was gone and checked a database the test
had already dropped, logging ``heartbeat.failed`` into later tests' output. The step
ends before the pool, whose children may still be running, so the member leaves the
active sets (no new work) but stays a lease holder until it expires."""

from __future__ import annotations

import threading

import redis
from celery import Celery

from teamdesk.config import Settings
from teamdesk.heartbeat import live_members, read_lease_holders, tombstone_key
from tests.support.workers import running_worker
from worker import life

THREAD = "teamdesk-liveness"


def renewal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD and t.is_alive()]


def test_a_terminated_worker_stops_renewing_and_stays_a_holder_until_it_expires(
    celery_app: Celery, settings: Settings, redis_client: redis.Redis
) -> None:
    assert renewal_threads() == [], "a renewal thread left over from an earlier test"
    with running_worker(celery_app):
        member = life.lease_holder()
        assert member is not None
        assert len(renewal_threads()) == 1
        assert live_members(redis_client, settings.queue_prefix) == {member}
        assert life.LIFE.state is life.State.CONSUMING
    assert renewal_threads() == []  # joined before the worker's thread ended
    assert life.lease_holder() is None
    assert life.LIFE.state is life.State.STOPPED
    assert live_members(redis_client, settings.queue_prefix) == set()
    holders = read_lease_holders(redis_client, settings.queue_prefix).members
    assert member in holders  # expires one TTL on, renewed by nothing
    ttl_ms = redis_client.pttl(tombstone_key(settings.queue_prefix, member))
    assert ttl_ms > 0  # the tombstone: a renewal still on its way is refused
