"""Worker heartbeats against the real Redis (docs/design.md, "Heartbeats")."""

from __future__ import annotations

import uuid

import redis

from dispatcher.scan import read_heartbeats
from harness.waiting import wait_for
from teamdesk.heartbeat import (
    EPOCH_TAG,
    TOMBSTONE_MIN_S,
    Heartbeat,
    active_key,
    has_heartbeat,
    holders_key,
    lease_holders_alive,
    live_members,
    read_lease_holders,
    tombstone_key,
)

SCOPE = "host-a"
TTL_S = 20.0


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1_000_000


def both_sets(prefix: str, scope: str = SCOPE) -> list[str]:
    return [active_key(prefix), active_key(prefix, scope)]


def test_renewal_adds_member_to_both_sets_scored_by_redis_time(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    before = redis_now(redis_client)

    assert beat.renew() is True

    after = redis_now(redis_client)
    scope, _, process_id = beat.member.partition("/")
    assert scope == SCOPE and uuid.UUID(process_id).version == 4
    for key in both_sets(queue_prefix):
        score = redis_client.zscore(key, beat.member)
        assert score is not None and before + TTL_S - 0.01 <= score <= after + TTL_S + 0.01
        assert redis_client.zcard(key) == 1
        assert 2 * TTL_S * 1000 - 1000 <= redis_client.pttl(key) <= 2 * TTL_S * 1000
    assert has_heartbeat(redis_client, queue_prefix, SCOPE) is True
    assert has_heartbeat(redis_client, queue_prefix) is True
    assert has_heartbeat(redis_client, queue_prefix, "host-b") is False
    assert live_members(redis_client, queue_prefix) == {beat.member}
    assert live_members(redis_client, queue_prefix, SCOPE) == {beat.member}


def test_renewal_extends_score_and_drops_expired_members(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert beat.renew() is True
    first = redis_client.zscore(active_key(queue_prefix), beat.member)
    dead = f"{SCOPE}/{uuid.uuid4()}"
    for key in both_sets(queue_prefix):
        redis_client.zadd(key, {dead: redis_now(redis_client) - 1})

    assert beat.renew() is True

    for key in both_sets(queue_prefix):
        assert redis_client.zrange(key, 0, -1) == [beat.member]
        score = redis_client.zscore(key, beat.member)
        assert first is not None and score is not None and score >= first


def test_two_processes_in_one_scope_one_leaving_keeps_the_other(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    leaving = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    staying = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert leaving.renew() is True and staying.renew() is True

    leaving.remove()

    assert leaving.stopping is True and staying.stopping is False
    assert has_heartbeat(redis_client, queue_prefix, SCOPE) is True
    assert has_heartbeat(redis_client, queue_prefix) is True
    for key in both_sets(queue_prefix):
        assert redis_client.zrange(key, 0, -1) == [staying.member]
    assert live_members(redis_client, queue_prefix, SCOPE) == {staying.member}
    assert leaving.renew() is False
    assert redis_client.zscore(active_key(queue_prefix), leaving.member) is None


def test_member_expires_by_redis_time(redis_client: redis.Redis, queue_prefix: str) -> None:
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, 0.3)
    assert beat.renew() is True
    score = redis_client.zscore(active_key(queue_prefix, SCOPE), beat.member)
    assert score is not None

    expired = wait_for(lambda: not has_heartbeat(redis_client, queue_prefix, SCOPE))

    assert expired, "the member never expired"
    assert redis_now(redis_client) >= score
    assert redis_client.zscore(active_key(queue_prefix, SCOPE), beat.member) is None
    assert live_members(redis_client, queue_prefix) == set()
    assert has_heartbeat(redis_client, queue_prefix) is False
    assert redis_client.zcard(active_key(queue_prefix)) == 0


def test_renewal_in_flight_when_shutdown_began_does_not_reregister(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert beat.renew() is True

    beat.remove()
    # The renewal that was already on its way reaches Redis only now: no Python-side check.
    replayed = beat._run_renewal()

    assert replayed is False
    for key in both_sets(queue_prefix):
        assert redis_client.zscore(key, beat.member) is None
    assert has_heartbeat(redis_client, queue_prefix, SCOPE) is False
    assert has_heartbeat(redis_client, queue_prefix) is False
    tombstone_ttl_ms = redis_client.pttl(tombstone_key(queue_prefix, beat.member))
    assert tombstone_ttl_ms > max(2 * TTL_S, TOMBSTONE_MIN_S) * 1000 - 5000


def test_tombstone_blocks_only_the_stopped_member(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    stopped = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    stopped.remove()
    successor = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)

    assert stopped._run_renewal() is False
    assert successor.renew() is True

    assert live_members(redis_client, queue_prefix, SCOPE) == {successor.member}
    assert live_members(redis_client, queue_prefix) == {successor.member}


def test_live_members_only_reads_while_has_heartbeat_prunes(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    key = active_key(queue_prefix)
    now = redis_now(redis_client)
    redis_client.zadd(key, {"host-a/old": now - 5, "host-a/new": now + 30})

    assert live_members(redis_client, queue_prefix) == {"host-a/new"}
    assert redis_client.zcard(key) == 2

    assert has_heartbeat(redis_client, queue_prefix) is True
    assert redis_client.zrange(key, 0, -1) == ["host-a/new"]


def test_the_record_carries_an_epoch_that_ages_by_redis_time(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    assert read_lease_holders(redis_client, queue_prefix).record_age_s is None  # no record
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, 0.3)
    assert beat.renew()
    first = read_lease_holders(redis_client, queue_prefix)
    assert first.members == {beat.member} and first.record_age_s is not None
    assert 0 <= first.record_age_s < 0.3
    assert read_heartbeats(redis_client, queue_prefix, 0.3).trusted is False

    assert wait_for(lambda: read_heartbeats(redis_client, queue_prefix, 0.3).trusted)
    assert beat.renew()  # renewals keep the epoch
    later = read_lease_holders(redis_client, queue_prefix)
    assert later.record_age_s is not None and later.record_age_s > 0.3
    [epoch] = redis_client.zrangebyscore(holders_key(queue_prefix), "+inf", "+inf")
    assert str(epoch).startswith(EPOCH_TAG)


def test_a_lost_record_is_not_trusted_until_a_new_one_is_a_ttl_old(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    """The holders set deleted (FLUSHDB, an eviction) takes its epoch with it; the next
    renewal starts a new one, trusted only one TTL later."""
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, 0.3)
    assert beat.renew()
    assert wait_for(lambda: read_heartbeats(redis_client, queue_prefix, 0.3).trusted)

    redis_client.delete(holders_key(queue_prefix))

    view = read_heartbeats(redis_client, queue_prefix, 0.3)
    assert (view.live, view.trusted, view.error) == (frozenset(), False, None)
    assert beat.renew()
    assert read_heartbeats(redis_client, queue_prefix, 0.3).trusted is False
    assert wait_for(lambda: read_heartbeats(redis_client, queue_prefix, 0.3).trusted)
    assert beat.renew()
    assert read_heartbeats(redis_client, queue_prefix, 0.3).live == {beat.member}


def test_an_epoch_of_another_server_is_replaced_and_never_trusted(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    """A replica promoted after a failover holds the old primary's epoch (its run_id)."""
    key = holders_key(queue_prefix)
    redis_client.zadd(key, {f"{EPOCH_TAG}{'0' * 40}/1.000000": float("inf")})
    assert read_lease_holders(redis_client, queue_prefix).record_age_s is None
    assert read_heartbeats(redis_client, queue_prefix, 0.3).live == frozenset()

    beat = Heartbeat(redis_client, queue_prefix, SCOPE, 0.3)
    assert beat.renew()

    [epoch] = redis_client.zrangebyscore(key, "+inf", "+inf")
    assert not str(epoch).startswith(f"{EPOCH_TAG}{'0' * 40}/")
    assert read_heartbeats(redis_client, queue_prefix, 0.3).trusted is False


def test_draining_member_keeps_leases_alive_but_takes_no_work(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, 0.5)
    other = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert beat.renew() and other.renew()
    beat.remove(draining=True)
    assert live_members(redis_client, queue_prefix) == {other.member}
    assert lease_holders_alive(redis_client, queue_prefix) == {beat.member, other.member}
    assert beat.renew() is False and beat._run_renewal() is False
    first = redis_client.zscore(holders_key(queue_prefix), beat.member)
    assert wait_for(lambda: redis_now(redis_client) > (first or 0) - 0.4)
    assert beat.renew_draining() is True
    assert (redis_client.zscore(holders_key(queue_prefix), beat.member) or 0) > (first or 0)
    # A process that froze while draining stops renewing and expires like any other.
    assert wait_for(lambda: beat.member not in lease_holders_alive(redis_client, queue_prefix))
    beat.finish()
    assert redis_client.zscore(holders_key(queue_prefix), beat.member) is None
    assert lease_holders_alive(redis_client, queue_prefix) == {other.member}


def test_a_drain_outlives_its_keys_and_their_loss_and_ends_for_good(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    """Each drain renewal registers the holder afresh and extends the holders key: past
    the key's own TTL, after the key was lost (a restart), and when the removal at SIGTERM
    never ran. Once finished, a drain renewal still on its way is refused."""
    beat = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert beat.renew()
    key = holders_key(queue_prefix)
    redis_client.pexpire(key, 50)  # as if the key's 2 x TTL were almost up
    assert beat.renew_draining() is True  # the removal at SIGTERM, or its retry
    assert redis_client.pttl(key) > 2 * TTL_S * 1000 - 1000
    assert live_members(redis_client, queue_prefix) == set()
    assert redis_client.get(tombstone_key(queue_prefix, beat.member)) == "draining"

    redis_client.delete(key, tombstone_key(queue_prefix, beat.member))  # Redis restarted
    assert beat.renew_draining() is True
    assert lease_holders_alive(redis_client, queue_prefix) == {beat.member}
    assert beat._run_renewal() is False  # still no active renewal: the tombstone is back

    beat.finish()
    assert beat.renew_draining() is False  # a late drain renewal
    assert lease_holders_alive(redis_client, queue_prefix) == set()
    assert redis_client.get(tombstone_key(queue_prefix, beat.member)) == "done"


def test_an_active_member_missing_from_the_holders_still_holds_its_leases(
    redis_client: redis.Redis, queue_prefix: str
) -> None:
    """A worker from before the holders set (a rolling upgrade) renews the active sets only;
    the dispatcher's read counts it alive all the same."""
    newer = Heartbeat(redis_client, queue_prefix, SCOPE, TTL_S)
    assert newer.renew()
    older = f"{SCOPE}/{uuid.uuid4()}"
    redis_client.zadd(active_key(queue_prefix), {older: redis_now(redis_client) + TTL_S})

    holders = read_lease_holders(redis_client, queue_prefix)

    assert holders.members == {newer.member, older}
    assert redis_client.zscore(holders_key(queue_prefix), older) is None
