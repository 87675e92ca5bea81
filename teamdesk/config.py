"""The environment variables, read and validated once (docs/design.md, "Configuration").

A bad value raises :class:`ConfigError` naming the variable; :func:`settings_or_exit`
makes it one stderr line and exit 2.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar
from urllib.parse import quote, unquote, urlsplit

from teamdesk import export_store

LOG_LEVELS = ("fatal", "error", "warn", "info", "debug", "trace", "silent")

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/teamdesk"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

_DATABASE_SCHEMES = ("postgresql", "postgresql+psycopg2", "postgres")
SENTINEL_SCHEME = "sentinel"
REDIS_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
_BROKER_SCHEMES = (*REDIS_SCHEMES, "amqp", "amqps", "pyamqp")
# kombu's form for Redis under Sentinel: every sentinel's URL, separated by ";".
SENTINEL_SEPARATOR = ";"


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server, directly or through its sentinels."""
    return urlsplit(url).scheme in REDIS_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` lists Redis sentinels (``sentinel://h:p[;sentinel://h2:p2...]``)
    rather than naming one Redis server."""
    return urlsplit(url).scheme == SENTINEL_SCHEME


DURABLE_PROGRESS_FRACTION = 4  # of STALE_AFTER_S (docs/design.md, "Lease")


class ConfigError(Exception):
    """A configuration variable has a value the process cannot run with."""


class Span(NamedTuple):
    """The values a duration setting accepts, both ends included."""

    low: float
    high: float
    unit: str  # "seconds" or "days", as the variable's name says

    def __str__(self) -> str:
        return f"from {self.low:g} to {self.high:g} {self.unit}"


# A value outside its range stops the process at start.
DURATIONS: dict[str, Span] = {
    "RETRY_BASE_DELAY_S": Span(0.0, 3600.0, "seconds"),  # later attempts double it
    # Below a second a round trip or a pause already looks like a stalled run.
    "STALE_AFTER_S": Span(1.0, 86_400.0, "seconds"),
    # The loop wakes on notifications: more than 10 scans a second only loads the database.
    "SCAN_INTERVAL_S": Span(0.1, 300.0, "seconds"),
    "HEARTBEAT_TTL_S": Span(1.0, 600.0, "seconds"),  # renewed every quarter, at most every 0.1 s
    "SHUTDOWN_TIMEOUT_S": Span(0.0, 3600.0, "seconds"),
    # At most the Redis broker's visibility timeout (an hour): past it the message returns.
    "EXPORT_READ_BUDGET_S": Span(1.0, 3600.0, "seconds"),
    # One day is the purge function's floor; far past ten years the cut-off leaves
    # PostgreSQL's dates and every purge fails.
    "TASK_RETENTION_DAYS": Span(1.0, 3650.0, "days"),
    "AUDIT_RETENTION_DAYS": Span(1.0, 3650.0, "days"),
}


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    redis_url: str = DEFAULT_REDIS_URL
    broker_url: str = DEFAULT_REDIS_URL
    queue_prefix: str = "teamdesk"
    log_level: str = "info"
    worker_instance_id: str = "localhost"
    max_task_attempts: int = 3
    retry_base_delay_s: float = 2.0
    stale_after_s: float = 120.0
    scan_interval_s: float = 3.0
    heartbeat_ttl_s: float = 20.0
    max_recoveries: int = 2
    export_max_rows: int = 10_000
    export_batch_size: int = 500
    shutdown_timeout_s: float = 75.0
    dispatch_window: int = 0  # 0: two per live worker process consuming the queue
    team_max_running: int = 0  # 0: no per-team cap (teams still share round-robin)
    dispatch_listen_url: str | None = ""  # "": DATABASE_URL; None: poll only, no LISTEN
    # Abuse limits (docs/design.md, "HTTP API"); 0 turns each one off.
    team_max_unfinished: int = 1000  # WAITING + RUNNING tasks of one team
    api_rate_per_min: int = 120  # create, retry and cancel requests per token, refilled
    api_rate_burst: int = 30  # ... of which this many at once
    auth_failures_per_min: int = 30  # 401 answers per client address (also the burst)
    api_read_rate_per_min: int = 600  # task reads, lists and CSV downloads per token
    api_read_burst: int = 120  # ... of which this many at once
    team_exports_per_day: int = 1000  # exports one team may create in 24 hours
    team_export_bytes_per_day: int = 2 << 30  # CSV bytes of one team's exports, 24 hours
    export_max_bytes: int = 32 << 20  # one export's CSV
    database_prepared_statements: bool = True  # off behind PgBouncer in transaction pooling
    metrics_port: int = 0  # 0: no /metrics
    metrics_host: str = "127.0.0.1"
    task_retention_days: float = 30.0
    audit_retention_days: float = 30.0
    redis_sentinel_master: str = ""
    redis_sentinel_password: str = ""
    export_read_budget_s: float = 60.0  # one COPY in all (docs/design.md, "Exports")
    export_store: str = "postgres"  # or "s3://BUCKET/PREFIX/"
    export_download: str = "stream"  # or "redirect" (an object store only)

    @property
    def listen_url(self) -> str | None:
        """Where the dispatcher LISTENs (a direct PostgreSQL connection), or None (off)."""
        if self.dispatch_listen_url == "":
            return self.database_url
        return self.dispatch_listen_url

    @property
    def durable_progress_after_s(self) -> float:
        """A progress write this long after the run's previous write commits durably."""
        return self.stale_after_s / DURABLE_PROGRESS_FRACTION

    def with_overrides(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]


T = TypeVar("T", int, float)


def _finite(env: Mapping[str, str], name: str, default: T, cast: Callable[[str], T]) -> T:
    """The variable as a finite number of ``cast``'s kind, or ``default`` when unset."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    kind = "a whole number" if cast is int else "a number"
    try:
        value = cast(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be {kind}, got {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):  # NaN / inf
        raise ConfigError(f"{name} must be {kind}, got {raw!r}")
    return value


def _number(
    env: Mapping[str, str], name: str, default: T, cast: Callable[[str], T], minimum: T
) -> T:
    value = _finite(env, name, default, cast)
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {env.get(name)!r}")
    return value


def _duration(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration setting, within its range in :data:`DURATIONS`."""
    value = _finite(env, name, default, float)
    span = DURATIONS[name]
    if not span.low <= value <= span.high:
        raise ConfigError(f"{name} must be {span}, got {env.get(name)!r}")
    return value


def _url(env: Mapping[str, str], name: str, default: str, schemes: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip()
    if is_sentinel_url(value) and SENTINEL_SCHEME in schemes:
        for chunk in value.split(SENTINEL_SEPARATOR):
            if not is_sentinel_url(chunk):
                raise ConfigError(
                    f"{name}: list every sentinel as sentinel://host:port, separated by ';'"
                )
            _one_url(name, chunk, schemes)
        return value
    _one_url(name, value, schemes)
    return value


def _one_url(name: str, value: str, schemes: tuple[str, ...]) -> None:
    """One server's URL; a PostgreSQL URL may list several hosts, as libpq allows
    (``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write``)."""
    try:
        parts = urlsplit(value)
        hosts = database_hosts(value) if parts.scheme in _DATABASE_SCHEMES else [parts.netloc]
        for host in hosts:
            urlsplit(f"//{host}").port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ConfigError(f"{name} is not a valid URL") from None
    if parts.scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ConfigError(f"{name} must start with one of {allowed}")
    if parts.scheme != "unix" and not all(urlsplit(f"//{host}").hostname for host in hosts):
        raise ConfigError(f"{name} must name a host")


def database_hosts(url: str) -> list[str]:
    """The ``host[:port]`` entries of a PostgreSQL URL (one, or libpq's comma-separated
    list for a primary and its standbys)."""
    netloc = urlsplit(url).netloc
    return netloc.rpartition("@")[2].split(",")


def _text(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip()
    if any(ch.isspace() for ch in value) or "/" in value:
        raise ConfigError(f"{name} must not contain spaces or '/'")
    return value


LISTEN_OFF = "off"


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``on`` or ``off`` (also true/false, 1/0, yes/no); unset: ``default``."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("on", "true", "1", "yes"):
        return True
    if raw in ("off", "false", "0", "no"):
        return False
    raise ConfigError(f"{name} must be on or off")


def _listen_url(env: Mapping[str, str]) -> str | None:
    """DISPATCH_LISTEN_URL: a PostgreSQL URL, ``off`` (poll only), or unset (DATABASE_URL)."""
    raw = (env.get("DISPATCH_LISTEN_URL") or "").strip()
    if raw.lower() == LISTEN_OFF:
        return None
    return _url(env, "DISPATCH_LISTEN_URL", "", _DATABASE_SCHEMES)


def _broker_url(env: Mapping[str, str], redis_url: str, queue_prefix: str) -> str:
    """BROKER_URL; on RabbitMQ its virtual host must be named like QUEUE_PREFIX, since
    queue names are not prefixed there (docs/design.md, "Processes")."""
    url = _url(env, "BROKER_URL", redis_url, _BROKER_SCHEMES)
    if is_redis_url(url):
        return url
    vhost = unquote(urlsplit(url).path[1:]) or "/"
    if vhost != queue_prefix:
        raise ConfigError(
            "BROKER_URL: on RabbitMQ each cluster needs its own virtual host, named like "
            f"QUEUE_PREFIX: end the URL with /{quote(queue_prefix, safe='')}"
        )
    return url


def _sentinel(env: Mapping[str, str], redis_url: str, broker_url: str) -> tuple[str, str]:
    """REDIS_SENTINEL_MASTER and REDIS_SENTINEL_PASSWORD: the master's name is needed
    exactly when REDIS_URL or BROKER_URL lists sentinels."""
    master = (env.get("REDIS_SENTINEL_MASTER") or "").strip()
    password = env.get("REDIS_SENTINEL_PASSWORD") or ""
    uses = is_sentinel_url(redis_url) or is_sentinel_url(broker_url)
    if uses and not master:
        raise ConfigError(
            "REDIS_SENTINEL_MASTER must name the master the sentinels monitor "
            "(REDIS_URL or BROKER_URL lists sentinels)"
        )
    if not uses and (master or password):
        raise ConfigError(
            "REDIS_SENTINEL_MASTER and REDIS_SENTINEL_PASSWORD apply only when REDIS_URL "
            "or BROKER_URL lists sentinels (sentinel://host:port;sentinel://...)"
        )
    if any(ch.isspace() for ch in master):
        raise ConfigError("REDIS_SENTINEL_MASTER must not contain spaces")
    return master, password


def _port(env: Mapping[str, str], name: str) -> int:
    port = _number(env, name, 0, int, 0)
    if port > 65535:
        raise ConfigError(f"{name} must be a TCP port (1-65535) or 0, got {env.get(name)!r}")
    return port


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every variable; raise ConfigError naming the first bad one."""
    env = os.environ if env is None else env
    level = env.get("LOG_LEVEL", "").strip().lower() or "info"
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"LOG_LEVEL must be one of {'|'.join(LOG_LEVELS)}, got {env.get('LOG_LEVEL')!r}"
        )
    redis_url = _url(env, "REDIS_URL", DEFAULT_REDIS_URL, REDIS_SCHEMES)
    queue_prefix = _text(env, "QUEUE_PREFIX", "teamdesk")
    broker_url = _broker_url(env, redis_url, queue_prefix)
    master, sentinel_password = _sentinel(env, redis_url, broker_url)
    stale_after_s = _duration(env, "STALE_AFTER_S", 120.0)
    return _checked(
        Settings(
            database_url=_url(env, "DATABASE_URL", DEFAULT_DATABASE_URL, _DATABASE_SCHEMES),
            redis_url=redis_url,
            broker_url=broker_url,
            queue_prefix=queue_prefix,
            log_level=level,
            worker_instance_id=_text(env, "WORKER_INSTANCE_ID", socket.gethostname()),
            max_task_attempts=_number(env, "MAX_TASK_ATTEMPTS", 3, int, 1),
            retry_base_delay_s=_duration(env, "RETRY_BASE_DELAY_S", 2.0),
            stale_after_s=stale_after_s,
            scan_interval_s=_duration(env, "SCAN_INTERVAL_S", 3.0),
            heartbeat_ttl_s=_duration(env, "HEARTBEAT_TTL_S", 20.0),
            max_recoveries=_number(env, "MAX_RECOVERIES", 2, int, 0),
            export_max_rows=_number(env, "EXPORT_MAX_ROWS", 10_000, int, 1),
            export_batch_size=_number(env, "EXPORT_BATCH_SIZE", 500, int, 1),
            shutdown_timeout_s=_duration(env, "SHUTDOWN_TIMEOUT_S", 75.0),
            dispatch_window=_number(env, "DISPATCH_WINDOW", 0, int, 0),
            team_max_running=_number(env, "TEAM_MAX_RUNNING", 0, int, 0),
            dispatch_listen_url=_listen_url(env),
            team_max_unfinished=_number(env, "TEAM_MAX_UNFINISHED", 1000, int, 0),
            api_rate_per_min=_number(env, "API_RATE_PER_MIN", 120, int, 0),
            api_rate_burst=_number(env, "API_RATE_BURST", 30, int, 1),
            auth_failures_per_min=_number(env, "AUTH_FAILURES_PER_MIN", 30, int, 0),
            api_read_rate_per_min=_number(env, "API_READ_RATE_PER_MIN", 600, int, 0),
            api_read_burst=_number(env, "API_READ_BURST", 120, int, 1),
            team_exports_per_day=_number(env, "TEAM_EXPORTS_PER_DAY", 1000, int, 0),
            team_export_bytes_per_day=_number(env, "TEAM_EXPORT_BYTES_PER_DAY", 2 << 30, int, 0),
            export_max_bytes=_number(env, "EXPORT_MAX_BYTES", 32 << 20, int, 0),
            database_prepared_statements=_switch(env, "DATABASE_PREPARED_STATEMENTS", True),
            metrics_port=_port(env, "METRICS_PORT"),
            metrics_host=_text(env, "METRICS_HOST", "127.0.0.1"),
            task_retention_days=_duration(env, "TASK_RETENTION_DAYS", 30.0),
            audit_retention_days=_duration(env, "AUDIT_RETENTION_DAYS", 30.0),
            redis_sentinel_master=master,
            redis_sentinel_password=sentinel_password,
            export_read_budget_s=_duration(env, "EXPORT_READ_BUDGET_S", 60.0),
            export_store=_export_store(env),
            export_download=_choice(env, "EXPORT_DOWNLOAD", DOWNLOAD_MODES),
        )
    )


DOWNLOAD_MODES = ("stream", "redirect")


def _export_store(env: Mapping[str, str]) -> str:
    """EXPORT_STORE, as ``postgres`` or ``s3://BUCKET/PREFIX/`` (checked and normalized)."""
    try:
        target = export_store.parse_store(env.get("EXPORT_STORE", ""))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return export_store.POSTGRES if target is None else target.url


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first when unset)."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return choices[0]
    if raw not in choices:
        raise ConfigError(f"{name} must be one of {'|'.join(choices)}, got {env.get(name)!r}")
    return raw


def _checked(settings: Settings) -> Settings:
    """Rules between settings. The daily bytes quota reserves EXPORT_MAX_BYTES for each
    unfinished export (ledger/quota.py): it needs that bound, and room for one export."""
    quota, most = settings.team_export_bytes_per_day, settings.export_max_bytes
    if quota > 0 and most == 0:
        raise ConfigError(
            "EXPORT_MAX_BYTES must be above 0 while TEAM_EXPORT_BYTES_PER_DAY is on "
            "(each unfinished export reserves EXPORT_MAX_BYTES of the quota)"
        )
    if settings.export_download == "redirect" and settings.export_store == export_store.POSTGRES:
        raise ConfigError(
            "EXPORT_DOWNLOAD=redirect needs an object store (EXPORT_STORE=s3://BUCKET): a CSV "
            "kept in PostgreSQL can only be streamed"
        )
    if 0 < quota < most:
        raise ConfigError(
            f"TEAM_EXPORT_BYTES_PER_DAY must be 0 (off) or at least EXPORT_MAX_BYTES ({most}),"
            f" got {quota}"
        )
    return settings


# Read by the API server only (cli/commands/serve.py, api/app.py).
FORWARDED_ALLOW_IPS = "FORWARDED_ALLOW_IPS"
DEFAULT_FORWARDED_ALLOW_IPS = "127.0.0.1,::1"  # uvicorn's own default
MSG_TRUST_ALL = (
    "FORWARDED_ALLOW_IPS='*' (or a network of every address, like 0.0.0.0/0 or ::/0) would "
    "take the client's address from the left of X-Forwarded-For, which the client writes "
    "itself: set it to your proxies' addresses or range (e.g. 10.0.0.0/8); see docs/api.md, "
    "'Behind a reverse proxy'"
)
ProxyNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_proxies(env: Mapping[str, str] | None = None) -> tuple[ProxyNetwork, ...]:
    """FORWARDED_ALLOW_IPS as networks. ConfigError for ``*``, for networks that together
    hold every address of a family (``0.0.0.0/1,128.0.0.0/1``) and for an entry that is
    neither an address nor a network."""
    env = os.environ if env is None else env
    raw = (env.get(FORWARDED_ALLOW_IPS) or "").strip() or DEFAULT_FORWARDED_ALLOW_IPS
    networks: list[ProxyNetwork] = []
    for entry in filter(None, (part.strip() for part in raw.split(","))):
        if entry == "*":
            raise ConfigError(MSG_TRUST_ALL)
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(
                f"FORWARDED_ALLOW_IPS: {entry!r} is not an IP address or network; list your "
                "proxies' addresses or ranges, separated by commas"
            ) from None
    if _hold_every_address(networks):
        raise ConfigError(MSG_TRUST_ALL)
    return tuple(networks)


def _hold_every_address(networks: list[ProxyNetwork]) -> bool:
    v4 = [n for n in networks if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in networks if isinstance(n, ipaddress.IPv6Network)]
    return any(n.prefixlen == 0 for n in ipaddress.collapse_addresses(v4)) or any(
        n.prefixlen == 0 for n in ipaddress.collapse_addresses(v6)
    )


_settings: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, validated on first use."""
    global _settings
    if _settings is None:
        _settings = load_settings()
    return _settings


def set_settings(settings: Settings | None) -> None:
    """Replace the process-wide settings (tests, or a CLI flag that overrides one)."""
    global _settings
    _settings = settings


def settings_or_exit() -> Settings:
    """For entry points: the settings, or one clear line on stderr and exit code 2."""
    try:
        return get_settings()
    except ConfigError as exc:
        print(f"teamdesk-tasks: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
