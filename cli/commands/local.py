"""``demo-seed`` and ``run-local`` (the local cluster of ``make run``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cli.commands.common import EXIT_OK, EXIT_STATUS_HELP, CommandError, guarded, port_arg
from teamdesk.config import settings_or_exit

DEFAULT_TICKETS = 3000  # cli.demo.DEFAULT_TICKETS (not imported: keeps --help light)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number") from None
    if not 0 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError("must be within 0..1000000")
    return value


def _slow_seconds(text: str) -> float:
    from tasks.demo_pause import parse_delay

    try:
        return parse_delay(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds within 0..5") from None


def cmd_demo_seed(args: argparse.Namespace) -> int:
    from cli import demo
    from teamdesk.db import get_engine

    with get_engine().begin() as conn:
        team = demo.seed(conn, tickets=args.tickets, token_name=args.token_name)
    print(json.dumps(team.as_dict()) if args.json else demo.describe(team))
    return EXIT_OK


def cmd_run_local(args: argparse.Namespace) -> int:
    from cli.localrun import RunError, options_from, run_local

    try:
        return run_local(settings_or_exit(), options_from(args))
    except RunError as exc:
        raise CommandError(str(exc)) from None


def register(sub: Any) -> None:
    seed = sub.add_parser(
        "demo-seed",
        help="create the demo team once, and print fresh API tokens for its users",
        description='Create (once) the team "Demo Support" with a staff and a customer user '
        f"and {DEFAULT_TICKETS} tickets; print the team id, the emails and one new API "
        "token per user. Running it again creates nothing and prints new tokens.",
        epilog=EXIT_STATUS_HELP,
    )
    seed.add_argument(
        "--tickets",
        type=_count,
        default=DEFAULT_TICKETS,
        metavar="N",
        help=f"tickets to create the first time (default: {DEFAULT_TICKETS})",
    )
    seed.add_argument("--json", action="store_true", help="print one JSON object")
    seed.add_argument(
        "--token-name", default="demo-seed", metavar="N", help="label of the new tokens"
    )
    seed.set_defaults(handler=guarded(cmd_demo_seed))

    run = sub.add_parser(
        "run-local",
        help="the local cluster of `make run`: workers, beat, Flower, API in the foreground",
        description="Create the database if missing, migrate, seed the demo team once, "
        "print the addresses and a ready-to-paste curl, then run the Procfile's processes "
        "(two workers, beat, Flower, the API) in the foreground. Ctrl-C or SIGTERM sends "
        "each process one SIGTERM (warm shutdown); exit 0 when all stopped cleanly.",
        epilog="Flower's password: FLOWER_PASSWORD, else a random one printed at start.",
    )
    run.add_argument(
        "--api-port",
        type=port_arg,
        help="the API's port (default: TEAMDESK_API_PORT or 8000)",
    )
    run.add_argument(
        "--flower-port",
        type=port_arg,
        help="Flower's port (default: TEAMDESK_FLOWER_PORT or 5555)",
    )
    run.add_argument(
        "--procfile", default=None, metavar="PATH", help="default: the project's Procfile"
    )
    run.add_argument(
        "--tickets",
        type=_count,
        default=DEFAULT_TICKETS,
        metavar="N",
        help=f"demo tickets, the first time (default: {DEFAULT_TICKETS})",
    )
    run.add_argument(
        "--slow-exports",
        type=_slow_seconds,
        metavar="S",
        help="DEMO ONLY: every export pauses S seconds (0..5) after each batch, so watch's "
        "bar and Flower's percent move (default: TEAMDESK_DEMO_SLOW_EXPORT_S, else 0 = off)",
    )
    run.set_defaults(handler=guarded(cmd_run_local))
