"""``teamdesk-tasks``, the operator's command line: ``migrate``, ``health`` and ``scan`` here,
the rest in ``cli/commands/`` (whose docstring says why handlers import late).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cli.commands import local, redis_acl, serve, task_commands, watch
from teamdesk.config import settings_or_exit
from teamdesk.failures import database_failure
from teamdesk.logs import setup_logging

Handler = Callable[[argparse.Namespace], int]


APP_PASSWORD_VAR = "APP_DB_PASSWORD"  # read by migrate only, never a command-line argument
API_PASSWORD_VAR = "API_DB_PASSWORD"  # likewise, for the API's role


def cmd_migrate(args: argparse.Namespace) -> int:
    from ledger.migrate import current_revision, upgrade

    settings = settings_or_exit()
    roles = _roles_to_set_up(args)
    if roles is None:
        return 2
    if args.create_database and not _create_database(settings.database_url):
        return 1
    try:
        upgrade(settings.database_url)
        revision = current_revision(settings.database_url)
    except Exception as exc:  # the driver's message may hold the address; print the class only
        return _migrate_failed(exc)
    print(f"schema at revision {revision}")
    if roles:
        return _set_up_roles(settings.database_url, roles)
    return 0


def _roles_to_set_up(args: argparse.Namespace) -> list[tuple[str, str, str | None]] | None:
    """``(kind, role, password)`` for each role named; None (after saying why) when a
    password is set for no role, or both options name one role."""
    roles = []
    for kind, role, var in (
        ("app", args.app_role, APP_PASSWORD_VAR),
        ("api", args.api_role, API_PASSWORD_VAR),
    ):
        password = os.environ.get(var) or None
        if password and not role:
            print(f"teamdesk-tasks migrate: {var} is set but --{kind}-role is not", file=sys.stderr)
            return None
        if role:
            roles.append((kind, role, password))
    if args.previous_api_grants and not args.api_role:
        print("teamdesk-tasks migrate: --previous-api-grants needs --api-role", file=sys.stderr)
        return None
    if args.previous_api_grants:
        roles = [("api+previous" if k == "api" else k, r, p) for k, r, p in roles]
    if args.app_role and args.app_role == args.api_role:
        print(
            "teamdesk-tasks migrate: --api-role must name another role than --app-role",
            file=sys.stderr,
        )
        return None
    return roles


def _create_database(database_url: str) -> bool:
    from cli.localrun import RunError, ensure_database

    try:
        if ensure_database(database_url):
            print("database created")
    except RunError as exc:
        print(f"teamdesk-tasks migrate: {exc}", file=sys.stderr)
        return False
    return True


def _set_up_roles(database_url: str, roles: list[tuple[str, str, str | None]]) -> int:
    from ledger.database_roles import AppRoleRefused
    from ledger.migrate import set_up_roles

    try:
        reports = set_up_roles(database_url, roles)
    except AppRoleRefused as exc:
        print(f"teamdesk-tasks migrate: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        return _migrate_failed(exc)
    for (granted, _, _), report in zip(roles, reports, strict=True):
        kind = granted.split("+", 1)[0]
        done = "created" if report.created else "password set" if report.password_set else "kept"
        print(
            f"{kind} role {report.role}: {done}; grants on {report.tables} tables, "
            f"{report.sequences} sequences and {report.functions} functions"
        )
    return 0


def _migrate_failed(exc: Exception) -> int:
    """One line on stderr: a statement of a migration that failed (the database was
    reached; re-running is safe: each revision commits as a whole, and an interrupted
    concurrent index build is redone), or a database that could not be reached."""
    from ledger.index_build import IndexBuildFailed

    if isinstance(exc, IndexBuildFailed):
        reason = exc.message
    elif getattr(exc, "statement", None):
        reason = (
            f"a migration statement failed: {database_failure(exc)}; running migrate "
            "again is safe (it redoes what did not complete)"
        )
    else:
        reason = (
            f"cannot migrate the database: {database_failure(exc)}; "
            "check DATABASE_URL and that PostgreSQL is running"
        )
    print(f"teamdesk-tasks migrate: {reason}", file=sys.stderr)
    return 1


def _role_name(value: str) -> str:
    from ledger.database_roles import valid_role_name

    if not valid_role_name(value):
        raise argparse.ArgumentTypeError(
            "a role name of lower-case letters, digits and '_', not starting with pg_"
        )
    return value


def cmd_health(args: argparse.Namespace) -> int:
    if args.cluster:
        from cli.cluster_health import cluster_command

        return cluster_command(settings_or_exit())
    from worker.probe import health_command

    return health_command(settings_or_exit(), args.scope)


def cmd_scan(args: argparse.Namespace) -> int:
    from dispatcher.command import scan_command

    return scan_command(settings_or_exit(), as_json=args.json)


class _PrintVersion(argparse.Action):
    """argparse's version action, reading the version only when asked (importing
    importlib.metadata costs ~25 ms that no other command should pay)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from teamdesk.version import version

        print(f"{parser.prog} {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="teamdesk-tasks",
        description="TeamDesk task cluster: ledger, dispatcher and worker operations. "
        "Configuration comes from the environment (DATABASE_URL, REDIS_URL, ...).",
        epilog="Every command has --help. Task commands exit 0 when done, 1 when refused "
        "or failed, 2 on invalid arguments or input.",
    )
    parser.add_argument(
        "--version", action=_PrintVersion, help="print the version (teamdesk-tasks X.Y.Z) and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    migrate = sub.add_parser(
        "migrate",
        help="apply database migrations (idempotent); set up the application's role",
        description="Bring the database schema to the newest revision, as the schema's "
        "owner (DATABASE_URL). With --app-role, then create or update the role the workers "
        "and the dispatcher connect as and re-apply its grants: rows of the project's tables "
        "only, no DDL; with --api-role, the API's narrower role the same way (in the same "
        "transaction). Safe to run again and from several hosts at once.",
        epilog=f"{APP_PASSWORD_VAR} / {API_PASSWORD_VAR}: the roles' passwords (read by "
        "migrate only; never pass them as arguments). Required to create a role; when set, "
        "an existing role's password is changed to it; when unset, an existing role keeps "
        "its password. The migrating role needs CREATEROLE to create or change a role.",
    )
    migrate.add_argument(
        "--create-database",
        action="store_true",
        help="first create the database DATABASE_URL names when it does not exist "
        "(through the server's 'postgres' maintenance database)",
    )
    migrate.add_argument(
        "--app-role",
        metavar="NAME",
        type=_role_name,
        help="after migrating, create or update this LOGIN role (e.g. teamdesk_app) with "
        "SELECT/INSERT/UPDATE/DELETE on the project's tables (task_audit: SELECT/INSERT) "
        f"and nothing else; password from {APP_PASSWORD_VAR}",
    )
    migrate.add_argument(
        "--api-role",
        metavar="NAME",
        type=_role_name,
        help="after migrating, create or update this LOGIN role (e.g. teamdesk_api) for the "
        "API: reads tasks, writes tasks and their audit rows, reads tokens and CSVs only "
        "through the owner's functions (ledger/api_database_role.py); password from "
        f"{API_PASSWORD_VAR}",
    )
    migrate.add_argument(
        "--previous-api-grants",
        action="store_true",
        help="with --api-role, during a rolling upgrade: also keep what the previous "
        "release's API reads (its token lookup, CSVs in the row) until it is replaced; run "
        "migrate again without it afterwards (CHANGELOG.md, Upgrading)",
    )
    migrate.set_defaults(handler=cmd_migrate)
    health = sub.add_parser(
        "health",
        help="check this host's worker heartbeat, Redis and PostgreSQL (exit 0 or 1)",
        description="Print one JSON line {worker, redis, database, scope} and exit 0 when "
        "the scope has a live worker heartbeat and Redis and PostgreSQL answer, else 1. "
        "Reads Redis and PostgreSQL directly (never the broker or the Celery app); "
        "answers within about 2 s, 4 s at most. Use it as the container health check.",
    )
    health.add_argument(
        "--scope",
        metavar="S",
        help="heartbeat scope to check (default: WORKER_INSTANCE_ID, else the hostname)",
    )
    health.add_argument(
        "--cluster",
        action="store_true",
        help="can this cluster run tasks? print {redis, database, dispatcher, consumers, "
        "missing, waiting, problems} and exit 0 only when PostgreSQL and Redis answer, a "
        "dispatcher leads and every task queue has a live worker; each problem also as one "
        'line on stderr ("no worker consumes exports (3 tasks waiting)")',
    )
    health.set_defaults(handler=cmd_health)
    scan = sub.add_parser(
        "scan",
        help="run one dispatcher scan now and print what it did",
        description="Run the dispatcher's scan once (what beat runs every SCAN_INTERVAL_S): "
        "recover silent runs, re-publish lost messages, fill the window with ready runs, "
        "purge expired CSVs. Prints one line (or one JSON object with --json) and exits 0; "
        "exits 1 when PostgreSQL or Redis cannot be reached. Safe to run while beat is "
        "running.",
    )
    scan.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    scan.set_defaults(handler=cmd_scan)
    serve.register(sub)
    redis_acl.register(sub)
    local.register(sub)
    task_commands.register(sub)
    watch.register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; an unknown option is refused with its command's usage and closest
    option (argparse's own answer is the top-level usage, which lists no option)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = _subcommand(parser, getattr(args, "command", None))
        target = command or parser
        known = [o for action in target._actions for o in action.option_strings]
        close = difflib.get_close_matches(extra[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        target.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _subcommand(parser: argparse.ArgumentParser, name: str | None) -> Any:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    settings = settings_or_exit()
    setup_logging("cli", settings.log_level)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
