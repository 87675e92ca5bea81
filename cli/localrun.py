"""The local cluster behind ``make run`` (``teamdesk-tasks run-local``): create the database
if missing, migrate, seed the demo team, print the addresses, then run the Procfile's
processes in the foreground (stopped as :mod:`cli.localmanager` says; docs/design.md, "Shutdown").
The Flower password is FLOWER_PASSWORD, else one kept in :data:`STATE_DIR` across runs.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import sqlalchemy as sa
from honcho.environ import parse_procfile
from sqlalchemy import exc as sa_exc

from cli import demo
from cli.demo import DemoTeam
from cli.localmanager import ClusterManager
from ledger.migrate import upgrade
from tasks.demo_pause import SLOW_EXPORT_ENV, delay_from_env
from teamdesk.config import Settings, is_sentinel_url
from teamdesk.db import make_engine, sqlalchemy_url
from teamdesk.failures import database_failure, redis_failure
from teamdesk.redis_client import redis_client

PROCFILE = Path(__file__).with_name("Procfile")
STATE_DIR = Path(__file__).resolve().parent.parent / ".localrun"  # git-ignored
FLOWER_PASSWORD_FILE = "flower_password"
REDIS_CHECK_TIMEOUT_S = 3.0
DEFAULT_REDIS_PORT = 6379
KILL_GRACE_S = 15.0  # past the workers' own drain budget (75 s) and hard-exit guard (10 s)
FLOWER_USER = "admin"
API_PORT_ENV = "TEAMDESK_API_PORT"
FLOWER_PORT_ENV = "TEAMDESK_FLOWER_PORT"
TOKEN_NAME = "make run"


class RunError(Exception):
    """The local cluster cannot start; the message says why and what to do."""


@dataclass(frozen=True)
class LocalOptions:
    api_port: int
    flower_port: int
    flower_password: str
    password_from_env: bool
    procfile: Path
    tickets: int
    slow_exports_s: float = 0.0  # demo only: tasks/demo_pause.py
    password_file: Path | None = None  # where the kept password is (None: from the env)


def read_procfile(path: Path) -> dict[str, str]:
    """``name: command`` lines (honcho's parser); comments and blank lines are skipped."""
    try:
        content = path.read_text()
    except OSError:
        raise RunError(f"cannot read {path}; run from a checkout of the project") from None
    processes = dict(parse_procfile(content).processes)
    if not processes:
        raise RunError(f"{path} names no processes")
    return processes


def exec_command(command: str) -> str:
    """``exec`` the command, so a signal to the child's pid reaches the program, not a shell."""
    return command if command.startswith("exec ") else f"exec {command}"


def child_env(options: LocalOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # Flower reads every FLOWER_* variable as one of its options and stops on one it does
    # not know; the password reaches it as FLOWER_BASIC_AUTH (never on a command line).
    env.pop("FLOWER_PASSWORD", None)
    env["FLOWER_BASIC_AUTH"] = f"{FLOWER_USER}:{options.flower_password}"
    env[API_PORT_ENV] = str(options.api_port)
    env[FLOWER_PORT_ENV] = str(options.flower_port)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop(SLOW_EXPORT_ENV, None)
    env.pop("METRICS_PORT", None)
    return env


def process_env(
    options: LocalOptions, command: str, shared: dict[str, str], metrics_port: int | None
) -> dict[str, str]:
    """One process's environment: ``shared`` (:func:`child_env`), its own METRICS_PORT
    when it serves metrics, and the demo's export pause for workers only (beat and Flower
    import the same app, and would print its DEMO ONLY warning for nothing)."""
    env = dict(shared)
    if metrics_port is not None:
        env["METRICS_PORT"] = str(metrics_port)
    if options.slow_exports_s > 0 and " worker " in f" {command} ":
        env[SLOW_EXPORT_ENV] = f"{options.slow_exports_s:g}"  # demo only: tasks/demo_pause.py
    return env


def ensure_database(database_url: str) -> bool:
    """Create DATABASE_URL's database through the server's ``postgres`` database when it
    does not exist; True when it was created. RunError when it cannot."""
    url = sa.engine.make_url(sqlalchemy_url(database_url))
    name = url.database
    if not name:
        raise RunError("DATABASE_URL names no database")
    admin = sa.create_engine(
        url.set(database="postgres"),
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
        connect_args={"connect_timeout": 5},
    )
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if exists:
                return False
            quoted = conn.dialect.identifier_preparer.quote_identifier(name)
            try:
                conn.execute(sa.text(f"CREATE DATABASE {quoted}"))
            except sa_exc.ProgrammingError as exc:
                if getattr(exc.orig, "pgcode", None) == "42P04":  # created meanwhile
                    return False
                raise
            return True
    except sa_exc.DBAPIError as exc:
        raise RunError(
            f"cannot create or open database {name!r}: {database_failure(exc)}; check "
            "DATABASE_URL and that PostgreSQL is running and lets this user create databases"
        ) from None
    finally:
        admin.dispose()


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def redis_hint(redis_url: str, error: str) -> str:
    """Why Redis could not be reached, naming REDIS_URL and its port (never its password);
    for a local address, the command that starts a Redis on that port."""
    parts = urlsplit(redis_url)
    if parts.scheme == "unix":
        return f"cannot reach Redis ({error}) at the socket REDIS_URL names; check REDIS_URL"
    if is_sentinel_url(redis_url):
        return (
            f"cannot reach Redis ({error}) through the sentinels REDIS_URL lists; check "
            "REDIS_URL, REDIS_SENTINEL_MASTER and that the sentinels know a master by that name"
        )
    port = parts.port or DEFAULT_REDIS_PORT
    text = f"cannot reach Redis ({error}) on port {port} (from REDIS_URL); check REDIS_URL"
    if (parts.hostname or "127.0.0.1") not in LOCAL_HOSTS:
        return text + " and that Redis is running there"
    return (
        f"{text} and start it, e.g.: redis-server --daemonize yes --bind 127.0.0.1 -::1 "
        f"--port {port} --save '' --appendonly no"
    )


def check_redis(settings: Settings) -> None:
    client = redis_client(settings, settings.redis_url, REDIS_CHECK_TIMEOUT_S)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RunError(redis_hint(settings.redis_url, redis_failure(exc))) from None
    finally:
        client.close()


def check_port(port: int, flag: str, variable: str) -> None:
    """Fail early, with the way out, when another program holds a port we need."""
    with socket.socket() as sock:
        # As the servers do: a port in TIME_WAIT after the previous run is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise RunError(
                f"port {port} on 127.0.0.1 is in use; choose another with {flag} or {variable}"
            ) from None


def prepare(settings: Settings, options: LocalOptions) -> DemoTeam:
    """Ports, Redis, database, schema, demo data; returns the demo team with a fresh
    token for its staff user."""
    check_port(options.api_port, "--api-port", API_PORT_ENV)
    check_port(options.flower_port, "--flower-port", FLOWER_PORT_ENV)
    check_redis(settings)
    created = ensure_database(settings.database_url)
    print(f"database: {'created' if created else 'exists'}", flush=True)
    try:
        upgrade(settings.database_url)
    except Exception as exc:  # the driver's text may hold the address: the class only
        raise RunError(f"cannot migrate the database ({type(exc).__name__})") from None
    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    try:
        with engine.begin() as conn:
            team = demo.seed(conn, tickets=options.tickets, token_name=TOKEN_NAME)
    finally:
        engine.dispose()
    return team


def banner(
    team: DemoTeam,
    options: LocalOptions,
    processes: dict[str, str],
    metrics: dict[str, int] | None = None,
) -> str:
    """The addresses and the ready-to-paste commands printed before the processes start."""
    api = f"http://127.0.0.1:{options.api_port}"
    token = team.staff.token
    auth = f'-H "Authorization: Bearer {token}"'
    kept = f"kept in {options.password_file}; " if options.password_file else ""
    password = (
        "(from FLOWER_PASSWORD)"
        if options.password_from_env
        else f"{options.flower_password}   ({kept}set FLOWER_PASSWORD to choose one)"
    )
    state = "created" if team.created else "already seeded"
    return "\n".join(
        [
            "",
            "TeamDesk local cluster: " + ", ".join(processes),
            f"  API      {api}   (OpenAPI: {api}/docs)",
            f"  Flower   http://127.0.0.1:{options.flower_port}   user {FLOWER_USER}, "
            f"password {password}",
            *_metrics_line(metrics or {}),
            f"  Demo     team {team.team_id} ({state}, {team.tickets} tickets)",
            *_slow_line(options),
            f"           staff {team.staff.email}, token {token}"
            + (f" (earlier {TOKEN_NAME!r} tokens revoked)" if team.revoked_tokens else ""),
            "",
            "Start an export:",
            f'  curl -s -X POST {auth} -H "Content-Type: application/json" -d '
            f'\'{{"scope":"TEAM","filters":{{}}}}\' {api}/api/teams/{team.team_id}/exports',
            "Read it back (the id is in the answer above):",
            f"  curl -s {auth} {api}/api/tasks/<TASK_ID>",
            f"  curl -s {auth} {api}/api/tasks/<TASK_ID>/csv   # the CSV, once COMPLETED",
            "  or follow it: .venv/bin/teamdesk-tasks watch <TASK_ID>",
            "",
            *_reminder_lines(team, auth, api),
            "Can the cluster run tasks? (dispatcher, a worker per queue, PostgreSQL, Redis)",
            f"  .venv/bin/teamdesk-tasks health --cluster      # or: curl -s {api}"
            "/api/workers/health",
            "  (plain `health` probes one worker host: `health --scope local-exports`)",
            "",
            "Ctrl-C stops everything (warm shutdown: running tasks finish first).",
            "",
        ]
    )


def _reminder_lines(team: DemoTeam, auth: str, api: str) -> list[str]:
    """A reminder that will really be sent: the ticket is open and assigned to the staff
    user (one that is closed or unassigned would complete "skipped")."""
    if team.reminder_ticket is None:
        return []
    body = f'{{"ticket_id":"{team.reminder_ticket}"}}'
    return [
        f"Send a reminder (ticket {team.reminder_ticket} is open, assigned to {team.staff.email}):",
        f'  curl -s -X POST {auth} -H "Content-Type: application/json" -d '
        f"'{body}' {api}/api/teams/{team.team_id}/reminders",
        "",
    ]


def _metrics_line(ports: dict[str, int]) -> list[str]:
    if not ports:
        return []
    each = ", ".join(f"{name} :{port}" for name, port in ports.items())
    return [f"  Metrics  http://127.0.0.1:<port>/metrics   {each}"]


def _slow_line(options: LocalOptions) -> list[str]:
    if options.slow_exports_s <= 0:
        return ["           exports too quick to watch? --slow-exports 2 (demo only)"]
    return [
        f"  DEMO     exports pause {options.slow_exports_s:g} s after each batch "
        "(EXPORT_BATCH_SIZE rows): watch the bar and Flower's task page move"
    ]


def cluster_manager(settings: Settings) -> ClusterManager:
    """The manager kills what is left :data:`KILL_GRACE_S` after the workers' drain budget."""
    drain_s = settings.shutdown_timeout_s
    return ClusterManager(stop_grace_s=drain_s + KILL_GRACE_S, drain_s=drain_s)


def metrics_ports(base: int, processes: dict[str, str]) -> dict[str, int]:
    """With METRICS_PORT set, a port per process that serves metrics (all but Flower),
    counted up from it in the Procfile's order (a shared one: 'address already in use')."""
    if not base:
        return {}
    serving = [name for name, command in processes.items() if " flower" not in f" {command}"]
    ports = {name: base + offset for offset, name in enumerate(serving)}
    if max(ports.values(), default=base) > 65535:
        raise RunError(f"METRICS_PORT {base} leaves no room for {len(ports)} ports")
    return ports


def _start_manager(
    options: LocalOptions,
    processes: dict[str, str],
    manager: ClusterManager,
    ports: dict[str, int],
) -> int:
    shared = child_env(options)
    for name, command in processes.items():
        env = process_env(options, command, shared, ports.get(name))
        manager.add_process(name, exec_command(command), env=env)
    manager.loop()
    return manager.returncode if manager.returncode is not None else 1


def run_local(settings: Settings, options: LocalOptions) -> int:
    processes = read_procfile(options.procfile)
    ports = metrics_ports(settings.metrics_port, processes)
    for port in ports.values():
        check_port(port, "another METRICS_PORT", "METRICS_PORT")
    team = prepare(settings, options)
    print(banner(team, options, processes, ports), flush=True)
    return _start_manager(options, processes, cluster_manager(settings), ports)


def _port_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise RunError(f"{name} must be a port number within 1..65535")
    return int(raw)


def options_from(args: Any) -> LocalOptions:
    """The options of ``run-local``; flags win over TEAMDESK_API_PORT / _FLOWER_PORT, and
    FLOWER_PASSWORD over the checkout's kept password (:func:`kept_flower_password`)."""
    from_env = os.environ.get("FLOWER_PASSWORD", "")
    if "," in from_env:
        raise RunError("FLOWER_PASSWORD must not contain ','")
    state_dir = STATE_DIR
    password_file = None if from_env else state_dir / FLOWER_PASSWORD_FILE
    return LocalOptions(
        api_port=args.api_port or _port_from_env(API_PORT_ENV, 8000),
        flower_port=args.flower_port or _port_from_env(FLOWER_PORT_ENV, 5555),
        flower_password=from_env or kept_flower_password(state_dir),
        password_from_env=bool(from_env),
        password_file=password_file,
        procfile=Path(args.procfile) if args.procfile else PROCFILE,
        tickets=args.tickets,
        slow_exports_s=_slow_exports(args),
    )


def kept_flower_password(state_dir: Path) -> str:
    """The checkout's Flower password, kept in ``state_dir`` (0700, file 0600) or made now.
    Written aside then linked in, so two runs starting at once agree on one password."""
    path = state_dir / FLOWER_PASSWORD_FILE
    try:
        kept = _read_password(path)
        if kept:
            return kept
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        password = secrets.token_urlsafe(12)  # URL-safe: never a ',' (FLOWER_BASIC_AUTH)
        aside = state_dir / f".{FLOWER_PASSWORD_FILE}.{os.getpid()}"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)  # whatever the umask
            out.write(password + "\n")
        try:
            os.link(aside, path)
        except FileExistsError:  # another run kept its own first: use that one
            password = _read_password(path) or password
        finally:
            aside.unlink(missing_ok=True)
        return password
    except OSError as exc:
        raise RunError(
            f"cannot keep the Flower password in {path} ({exc.strerror or exc}); "
            "set FLOWER_PASSWORD to choose one"
        ) from None


def _read_password(path: Path) -> str:
    """The kept password ('' when there is none yet); a file others may read is made 0600."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return ""
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    if "," in text or any(c.isspace() for c in text):
        raise RunError(f"{path} must hold one password, without ',' or spaces")
    return text


def _slow_exports(args: Any) -> float:
    """``--slow-exports`` wins over TEAMDESK_DEMO_SLOW_EXPORT_S; 0 (off) by default."""
    if getattr(args, "slow_exports", None) is not None:
        return float(args.slow_exports)
    try:
        return delay_from_env()
    except ValueError as exc:
        raise RunError(str(exc)) from None
