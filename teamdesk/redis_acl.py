"""Redis ACL users, one per process role (docs/design.md, "Processes"; deploy/security.md,
"Redis users"): the one place their rules are written. ``teamdesk-tasks redis-acl``
prints them (an ACL file, or ``ACL SETUSER`` commands), and deploy/redis/users.acl is its
output for the default prefix.

Keys start with ``<QUEUE_PREFIX>:`` (P); Celery's fanout channels are
``P:/<db>.P.celeryev/<routing key>`` and ``P:/<db>.P.control.pidbox``. Flower takes
kombu's restore mutex and reads the unacknowledged index, as every consumer's channel
does, but cannot push a message back (the workers restore). Commands are listed, never
granted by category (``+@write`` would also grant FLUSHALL), but for :data:`CONNECTION`.
A role may still run a script of its own (Redis 7 cannot allow one by SHA), whose every command
Redis checks against the same rules (deploy/security.md, "Redis users").
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COMPONENTS = ("api", "worker", "beat", "flower")
ADMIN = "default"
PASSWORD_VARS = {
    ADMIN: "REDIS_PASSWORD",
    "api": "REDIS_API_PASSWORD",
    "worker": "REDIS_WORKER_PASSWORD",
    "beat": "REDIS_BEAT_PASSWORD",
    "flower": "REDIS_FLOWER_PASSWORD",
}
# A prefix is written into key and channel patterns: no glob or space may hide in it.
PLAIN_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MSG_PREFIX = "QUEUE_PREFIX must be letters, digits, '_', '.' or '-' to write Redis ACL rules"

# A category, since its commands differ between versions and a rule naming one the server
# lacks (CLIENT SETINFO before 7.2) refuses the whole file; less its admin and dangerous
# members, tracking and SELECT (key patterns hold in every database: :func:`_select`).
CONNECTION = ("+@connection", "-@admin", "-@dangerous", "-client|tracking", "-select")
# The script commands each role's code runs: redis-py's scripts and Lock send EVALSHA and,
# on NOSCRIPT, SCRIPT LOAD (in a pipeline SCRIPT EXISTS first); heartbeat reads are
# EVALSHA_RO. Workers and Flower run kombu's restore mutex and binding refresh.
SCRIPTS = {
    "api": ("+evalsha", "+evalsha_ro", "+script|load"),
    "beat": ("+evalsha", "+evalsha_ro", "+script|load"),
    "worker": ("+evalsha", "+evalsha_ro", "+script|load", "+script|exists"),
    "flower": ("+evalsha", "+script|load", "+script|exists"),
}
TRANSACTIONS = ("+multi", "+exec", "+discard", "+watch", "+unwatch")
# kombu's Redis channel: queues, bindings, its scripts (binding deadlines, the restore
# mutex), fanout over pub/sub.
KOMBU_CONSUMER = (
    "+brpop",
    "+llen",
    "+del",
    "+exists",
    "+sadd",
    "+srem",
    "+smembers",
    "+set",
    "+get",
    "+pexpire",
    "+time",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zrangebyscore",
    "+publish",
    "+psubscribe",
    "+punsubscribe",
    "+subscribe",
    "+unsubscribe",
)

API_COMMANDS = ("+exists", "+mget", "+get", "+set", "+time", "+zcount", "+zrangebyscore")
BEAT_COMMANDS = (
    "+info",
    "+lpush",
    "+llen",
    "+lrange",
    "+hvals",
    "+sadd",
    "+smembers",
    "+exists",
    "+set",
    "+get",
    "+del",
    "+pexpire",
    "+mget",
    "+time",
    "+zrangebyscore",
)
WORKER_COMMANDS = (
    *KOMBU_CONSUMER,
    "+lpush",
    "+info",
    "+rpop",
    "+rpush",
    "+lrange",
    "+hset",
    "+hget",
    "+hdel",
    "+hvals",
    "+setex",
    "+mget",
    "+zcard",
    "+zcount",
    "+zremrangebyscore",
    "+zrevrangebyscore",
)
FLOWER_COMMANDS = KOMBU_CONSUMER


@dataclass(frozen=True)
class Layout:
    """Where a cluster keeps its Redis state: ``prefix`` (QUEUE_PREFIX), its task
    ``queues`` and the broker's database number (in Celery's channel names)."""

    prefix: str
    queues: tuple[str, ...]
    db: int = 0

    def __post_init__(self) -> None:
        if not PLAIN_PREFIX.fullmatch(self.prefix):
            raise ValueError(MSG_PREFIX)

    def key(self, rest: str) -> str:
        return f"{self.prefix}:{rest}"

    @property
    def events(self) -> str:
        """Celery's event exchange, a fanout on Redis (tasks/celery_app.py)."""
        return f"{self.prefix}.celeryev"

    @property
    def pidbox(self) -> str:
        """Celery's remote-control (pidbox) exchange."""
        return f"{self.prefix}.control.pidbox"

    def channel(self, exchange: str) -> str:
        return self.key(f"/{self.db}.{exchange}")


def user_name(role: str, prefix: str) -> str:
    """A role's user: ``<prefix>-<role>`` (clusters sharing a Redis keep theirs apart);
    the administrator is Redis's ``default``."""
    return ADMIN if role == ADMIN else f"{prefix}-{role}"


def password_hash(password: str) -> str:
    """How Redis stores a password (``#<sha256 hex>`` in a rule)."""
    return hashlib.sha256(password.encode()).hexdigest()


def placeholder(role: str) -> str:
    """Where a password's hash goes in the example file. Redis refuses to load it as it
    is (not 64 hex digits): a file nobody filled in starts no server."""
    return f"sha256({PASSWORD_VARS[role]})"


def _queue_keys(layout: Layout, access: str) -> list[str]:
    """The task queues' lists (kombu adds ``\\x06\\x16<priority>`` to a queue's name)."""
    return [f"{access}{layout.key(queue)}*" for queue in layout.queues]


def _bindings(layout: Layout, exchanges: Sequence[str]) -> list[str]:
    """kombu's binding tables of ``exchanges`` (and their permanent sets)."""
    return [
        f"~{layout.key(table)}{exchange}"
        for exchange in exchanges
        for table in ("_kombu.binding.", "_kombu.binding_permanent.")
    ]


def _heartbeats(layout: Layout) -> str:
    return layout.key("worker-heartbeat:*")


def _api(layout: Layout) -> list[str]:
    return [
        *API_COMMANDS,
        f"~{layout.key('ratelimit:*')}",
        f"%R~{layout.key('dispatcher:leader')}",
        f"%R~{layout.key('worker-heartbeat:active')}",
        f"%R~{layout.key('worker-heartbeat:info:*')}",
    ]


def _beat(layout: Layout) -> list[str]:
    return [
        *TRANSACTIONS,
        *BEAT_COMMANDS,
        *_queue_keys(layout, "~"),
        *_bindings(layout, layout.queues),
        f"%R~{layout.key('unacked')}",
        f"~{layout.key('dispatcher:leader')}",
        f"%R~{_heartbeats(layout)}",
    ]


def _worker(layout: Layout) -> list[str]:
    return [
        *TRANSACTIONS,
        *WORKER_COMMANDS,
        *_queue_keys(layout, "~"),
        *(f"~{layout.key(name)}" for name in ("unacked", "unacked_index", "unacked_mutex")),
        f"~{layout.key('_kombu.*')}",
        f"~{layout.key('*.' + layout.pidbox + '*')}",
        f"~{layout.key('celeryev.*')}",
        f"~{layout.key('celery-task-meta-*')}",
        f"~{_heartbeats(layout)}",
        f"&{layout.channel(layout.events)}/*",
        f"&{layout.channel(layout.events)}/worker.*",
        f"&{layout.channel(layout.pidbox)}",
        f"&{layout.key('celery-task-meta-*')}",
    ]


def _flower(layout: Layout) -> list[str]:
    reply = f"reply.{layout.pidbox}"
    return [
        *TRANSACTIONS,
        *FLOWER_COMMANDS,
        *_queue_keys(layout, "%R~"),
        f"~{layout.key('*.' + reply + '*')}",
        f"~{layout.key('celeryev.*')}",
        *_bindings(layout, (layout.events, layout.pidbox, reply)),
        f"~{layout.key('_kombu.binding_deadlines')}",
        f"~{layout.key('unacked_mutex')}",
        f"%R~{layout.key('unacked_index')}",
        f"%R~{layout.key('unacked')}",
        f"&{layout.channel(layout.events)}/*",
        f"&{layout.channel(layout.pidbox)}",
    ]


GRANTS = {"api": _api, "beat": _beat, "worker": _worker, "flower": _flower}


def _select(layout: Layout) -> list[str]:
    """SELECT of the cluster's own database only (Redis 7 allows one first argument of a
    command without subcommands); on database 0 none is needed."""
    return [f"+select|{layout.db}"] if layout.db else []


def component_rules(role: str, layout: Layout) -> list[str]:
    """What ``role`` may run, touch and publish (no ``reset``, no password)."""
    if role == ADMIN:
        return ["~*", "&*", "+@all"]
    return [*CONNECTION, *_select(layout), *SCRIPTS[role], *GRANTS[role](layout)]


def acl_rules(role: str, layout: Layout, hashed: str) -> list[str]:
    """The full rule list of ``role``'s user, password ``hashed`` (see
    :func:`password_hash`): starts from ``reset``, so applying it again replaces it."""
    return ["reset", "on", f"#{hashed}", *component_rules(role, layout)]


def acl_file_line(role: str, layout: Layout, hashed: str) -> str:
    return " ".join(["user", user_name(role, layout.prefix), *acl_rules(role, layout, hashed)])


def setuser_line(role: str, layout: Layout, hashed: str) -> str:
    """The same user as an ``ACL SETUSER`` command (for ``redis-cli``)."""
    return " ".join(
        ["ACL", "SETUSER", user_name(role, layout.prefix), *acl_rules(role, layout, hashed)]
    )


def acl_file(layout: Layout, hashes: Mapping[str, str]) -> str:
    """An ACL file (``aclfile``) with the administrator and every role, in that order:
    an ACL file replaces every user, so it must define ``default`` too (left out, Redis
    makes it password-less with every right, ``requirepass`` notwithstanding)."""
    return "".join(
        acl_file_line(role, layout, hashes[role]) + "\n" for role in (ADMIN, *COMPONENTS)
    )
