"""What every task command shares: argument types, error handling, exit codes (EXIT_STATUS_HELP).

Expected failures print one line on stderr, never a traceback nor a driver's message
(which may hold the database address).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from teamdesk.failures import database_unusable

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_INPUT = 2

EXIT_STATUS_HELP = (
    "exit status: 0 done; 1 refused or failed (not found, not allowed, wrong state, "
    "PostgreSQL unreachable); 2 invalid arguments or input"
)

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A failure the command explains in one line; ``exit_code`` is what it exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def uuid_arg(text: str) -> uuid.UUID:
    """argparse type: a UUID (the message does not echo the input)."""
    try:
        return uuid.UUID(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("must be a UUID, like 0b9d2c3e-...") from None


def aware_datetime_arg(text: str) -> datetime:
    """argparse type: an ISO 8601 date and time with a time zone (``Z`` allowed)."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            "must be an ISO 8601 date and time, like 2026-01-05T09:00:00+00:00"
        ) from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError("must include a time zone, like Z or +01:00")
    return value


def json_arg(text: str) -> Any:
    """argparse type: any JSON value (the ledger decides whether it is valid filters)."""
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError('must be JSON, like \'{"status": ["OPEN"]}\'') from None


def positive_float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be more than 0")
    return value


def port_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be within 1..65535")
    return value


def command_name(args: argparse.Namespace) -> str:
    parts = ["teamdesk-tasks", args.command, getattr(args, "action", None)]
    return " ".join(p for p in parts if p)


def say_error(args: argparse.Namespace, message: str) -> None:
    print(f"{command_name(args)}: {message}", file=sys.stderr)


def guarded(handler: Handler) -> Handler:
    """Run ``handler``; turn the expected failures into one stderr line and an exit code."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        import psycopg2
        from sqlalchemy import exc as sa_exc

        from ledger.errors import InvalidFilters, InvalidInput, LedgerError

        try:
            return handler(args)
        except CommandError as exc:
            say_error(args, str(exc))
            return exc.exit_code
        except (InvalidInput, InvalidFilters) as exc:
            say_error(args, exc.message)
            return EXIT_INPUT
        except LedgerError as exc:
            say_error(args, exc.message)
            return EXIT_REFUSED
        except (
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
            psycopg2.OperationalError,  # the hot-path statements go straight to the driver
            psycopg2.InterfaceError,
        ) as exc:
            say_error(args, database_unusable(exc))
            return EXIT_REFUSED
        except (sa_exc.ProgrammingError, psycopg2.ProgrammingError) as exc:
            if getattr(getattr(exc, "orig", exc), "pgcode", None) != "42P01":  # undefined_table
                raise
            say_error(args, "the database has no schema yet; run: teamdesk-tasks migrate")
            return EXIT_REFUSED

    return run
