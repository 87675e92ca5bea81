"""``teamdesk-tasks``: the operator's command line.

``migrate``, ``health`` and ``scan`` are here; the others live in ``cli/commands/``
(``serve`` = api, ``local`` = demo-seed and run-local, ``task_commands`` = submit, status,
retry, cancel, token, ``watch``). Parsing imports only the standard library and the light
foundation, so ``--help`` and the ``health`` probe stay fast and never load Celery; each
handler imports what it needs when it runs (see ``cli/commands/__init__.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from cli.commands import local, serve, task_commands, watch
from teamdesk.config import settings_or_exit
from teamdesk.logs import setup_logging

Handler = Callable[[argparse.Namespace], int]


def cmd_migrate(args: argparse.Namespace) -> int:
    from ledger.migrate import current_revision, upgrade

    settings = settings_or_exit()
    if args.create_database:
        from cli.localrun import RunError, ensure_database

        try:
            if ensure_database(settings.database_url):
                print("database created")
        except RunError as exc:
            print(f"teamdesk-tasks migrate: {exc}", file=sys.stderr)
            return 1
    try:
        upgrade(settings.database_url)
        revision = current_revision(settings.database_url)
    except Exception as exc:  # the driver's message may hold the address; print the class only
        print(
            f"teamdesk-tasks migrate: cannot migrate the database ({type(exc).__name__}); "
            "check DATABASE_URL and that PostgreSQL is running",
            file=sys.stderr,
        )
        return 1
    print(f"schema at revision {revision}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    if args.cluster:
        from dispatcher.roles import cluster_command

        return cluster_command(settings_or_exit())
    from worker.probe import health_command

    return health_command(settings_or_exit(), args.scope)


def cmd_scan(args: argparse.Namespace) -> int:
    from dispatcher.command import scan_command

    return scan_command(settings_or_exit(), as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="teamdesk-tasks",
        description="TeamDesk task cluster: ledger, dispatcher and worker operations. "
        "Configuration comes from the environment (DATABASE_URL, REDIS_URL, ...).",
        epilog="Every command has --help. Task commands exit 0 when done, 1 when refused "
        "or failed, 2 on invalid arguments or input.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    migrate = sub.add_parser(
        "migrate",
        help="apply database migrations (idempotent)",
        description="Bring the database schema to the newest revision. "
        "Safe to run again and from several hosts at once.",
    )
    migrate.add_argument(
        "--create-database",
        action="store_true",
        help="first create the database DATABASE_URL names when it does not exist "
        "(through the server's 'postgres' maintenance database)",
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
        help="check the cluster's roles instead: print {redis, dispatcher, consumers, "
        "missing} and exit 0 only when a dispatcher leads and every task queue has a live "
        "worker",
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
    local.register(sub)
    task_commands.register(sub)
    watch.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_or_exit()
    except SystemExit:
        # Container health checks reserve exit code 2; the probe only says 0 or 1.
        if args.command == "health":
            return 1
        raise
    setup_logging("cli", settings.log_level)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
