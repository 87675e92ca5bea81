"""``submit export|reminder``, ``status``, ``retry``, ``cancel``, ``token create|list|revoke``.

They act through ``ledger.service`` and ``ledger.tokens`` as the user named by
``--user EMAIL``, so the CLI authorises exactly like the API, and creations and retries
respect the team's cap on unfinished tasks (``TEAM_MAX_UNFINISHED``) as the API does.
They write the ledger only: the dispatcher (beat) publishes new and retried runs as soon
as they are ready. (The API's rate limits are for HTTP clients; the CLI has none.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from cli.commands.common import (
    EXIT_OK,
    EXIT_STATUS_HELP,
    aware_datetime_arg,
    guarded,
    json_arg,
    say_error,
    uuid_arg,
)

T = TypeVar("T")

# ledger.tokens.DEFAULT_TTL_DAYS and MAX_TTL_DAYS (not imported: keeps --help light)
TOKEN_TTL_DAYS = 90
ROLES_TIMEOUT_S = 1.0  # Redis, when a late task's waiting_reason is wanted
TOKEN_MAX_TTL_DAYS = 365
TOKEN_COLUMNS = ("id", "name", "created_at", "last_used_at", "expires_at", "state")
# A creation or retry is tried this many times in all when the database fails in a way
# that passes (a lost connection, a failover), with the invocation's idempotency key.
ATTEMPTS = 3
RETRY_PAUSE_S = 1.0
KEY_HELP = (
    "an idempotency key of your choosing (a UUID; letters, digits or - _ . : ~ + / =, at "
    "most 128): the same command run again with it within 24 hours answers what the first "
    "did and creates nothing (default: a new key per invocation, reused when the command "
    "tries again after a lost connection)"
)

PUBLISH_NOTE = (
    "The command only writes the WAITING row; the dispatcher (beat) publishes it to the "
    "queue as soon as it is ready (or `teamdesk-tasks scan` does, once)."
)


def _user(conn: Any, email: str) -> uuid.UUID:
    from ledger.tokens import user_id_by_email

    return user_id_by_email(conn, email)


def _team_cap() -> int:
    from teamdesk.config import get_settings

    return get_settings().team_max_unfinished


def _export_quota() -> Any:
    from ledger.quota import ExportQuota
    from teamdesk.config import get_settings

    return ExportQuota.of(get_settings())


def _print_created(view: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(view.as_dict(), sort_keys=True))
    else:
        print(view.as_dict()["id"])


def _idempotent(args: argparse.Namespace, attempt: Callable[[str], T]) -> T:
    """``attempt(key)`` with this invocation's Idempotency-Key (``--idempotency-key``, or
    a new UUID), tried again with the same key after a transient database failure
    (ledger.prepared.is_transient): a commit whose answer was lost is answered by its key
    the next time, never made twice (ledger/idempotency.py)."""
    from ledger.prepared import is_transient
    from teamdesk import hooks
    from teamdesk.failures import database_unusable

    key = str(uuid.uuid4()) if args.idempotency_key is None else args.idempotency_key
    for number in range(1, ATTEMPTS + 1):
        try:
            done = attempt(key)
            hooks.fire("cli.after_commit", key=key)
            return done
        except Exception as exc:
            if number == ATTEMPTS or not is_transient(exc):
                raise
            say_error(
                args,
                f"{database_unusable(exc)}; trying again ({number + 1} of {ATTEMPTS}) "
                "with the same idempotency key",
            )
            time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def cmd_submit_export(args: argparse.Namespace) -> int:
    from ledger import service
    from teamdesk.db import get_engine

    def attempt(key: str) -> Any:
        with get_engine().begin() as conn:
            user_id = _user(conn, args.user)
            return service.submit_export(
                conn,
                args.team,
                user_id,
                args.scope,
                args.filters,
                max_unfinished=_team_cap(),
                export_quota=_export_quota(),
                idempotency_key=key,
            )

    _print_created(_idempotent(args, attempt), args.json)
    return EXIT_OK


def cmd_submit_reminder(args: argparse.Namespace) -> int:
    from ledger import service
    from teamdesk.db import get_engine

    def attempt(key: str) -> Any:
        with get_engine().begin() as conn:
            user_id = _user(conn, args.user)
            return service.submit_reminder(
                conn,
                args.team,
                user_id,
                args.ticket,
                args.run_at,
                max_unfinished=_team_cap(),
                idempotency_key=key,
            )

    _print_created(_idempotent(args, attempt), args.json)
    return EXIT_OK


def read_view(conn: Any, task_id: uuid.UUID, email: str | None) -> dict[str, Any]:
    """The task as ``email`` may see it, or (no email) the operator's view of the row."""
    from ledger import service

    if email is not None:
        return service.get_task(conn, task_id, _user(conn, email)).as_dict()
    return service.read_task_as_operator(conn, task_id).as_dict()


def read_roles_once() -> Any:
    """The cluster's roles from Redis (None when it does not answer within 1 s)."""
    from api.cluster import process_roles_or_none
    from teamdesk.config import get_settings
    from teamdesk.redis_client import redis_client

    settings = get_settings()
    client = redis_client(settings, settings.redis_url, ROLES_TIMEOUT_S)
    try:
        return process_roles_or_none(client, settings.queue_prefix)
    finally:
        client.close()


def explained(view: dict[str, Any]) -> dict[str, Any]:
    """The view with ``waiting_reason``, as the API gives it (api/cluster.py)."""
    from api.cluster import explain_waiting

    explain_waiting([view], read_roles_once)
    return view


def cmd_status(args: argparse.Namespace) -> int:
    from api.cluster import waiting_line
    from teamdesk.db import get_engine

    with get_engine().connect() as conn:
        view = explained(read_view(conn, args.id, args.user))
    print(json.dumps(view, indent=2, sort_keys=True))
    line = waiting_line(view)
    if line:
        print(line, file=sys.stderr)
    return EXIT_OK


def cmd_retry(args: argparse.Namespace) -> int:
    from ledger import service
    from teamdesk.db import get_engine

    def attempt(key: str) -> int:
        with get_engine().begin() as conn:
            user_id = _user(conn, args.user)
            cap, quota = _team_cap(), _export_quota()
            return service.reopen(conn, args.id, user_id, cap, quota, key).run

    run = _idempotent(args, attempt)
    print(
        f"{args.id}: run {run} is WAITING, ready now (a retry does not keep a reminder's "
        "scheduled time); the dispatcher will publish it"
    )
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from ledger import service
    from teamdesk.db import get_engine

    with get_engine().begin() as conn:
        service.cancel(conn, args.id, _user(conn, args.user))
    print(f"{args.id}: CANCELLED")
    return EXIT_OK


def cmd_token_create(args: argparse.Namespace) -> int:
    from ledger.tokens import create_token
    from teamdesk.db import get_engine

    with get_engine().begin() as conn:
        raw = create_token(conn, _user(conn, args.email), args.name, args.expires_in_days)
    print(raw)
    return EXIT_OK


def _when(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _token_view(token: dict[str, Any]) -> dict[str, str | None]:
    """What `token list` shows of a token: never its hash."""
    view = {column: token[column] for column in TOKEN_COLUMNS}
    for column in ("created_at", "last_used_at", "expires_at"):
        view[column] = _when(view[column])
    view["id"] = str(view["id"])
    return view


def cmd_token_list(args: argparse.Namespace) -> int:
    from ledger.tokens import list_tokens
    from teamdesk.db import get_engine

    with get_engine().begin() as conn:
        rows = [_token_view(token) for token in list_tokens(conn, _user(conn, args.email))]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    cells = [[row[c] or "-" for c in TOKEN_COLUMNS] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in cells)]) for i, c in enumerate(TOKEN_COLUMNS)]
    for line in [list(TOKEN_COLUMNS), *cells]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
    return EXIT_OK


def cmd_token_revoke(args: argparse.Namespace) -> int:
    from ledger.tokens import revoke_token
    from teamdesk.db import get_engine

    with get_engine().begin() as conn:
        revoked = revoke_token(conn, args.id)
    print(f"{args.id}: {'revoked' if revoked else 'already revoked'}")
    return EXIT_OK


def ttl_days_arg(text: str) -> int:
    """argparse type: a token's lifetime in whole days."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number of days") from None
    if not 1 <= value <= TOKEN_MAX_TTL_DAYS:
        raise argparse.ArgumentTypeError(f"must be within 1..{TOKEN_MAX_TTL_DAYS}")
    return value


def _add_user(parser: argparse.ArgumentParser, required: bool = True, extra: str = "") -> None:
    parser.add_argument(
        "--user",
        metavar="EMAIL",
        required=required,
        help="act as this user (authorised as in the API)" + extra,
    )


def _sub(sub: Any, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description, epilog=EXIT_STATUS_HELP
    )
    return parser


def _register_submit(sub: Any) -> None:
    submit = _sub(
        sub, "submit", "create an export or a reminder task", "Create a task. " + PUBLISH_NOTE
    )
    kinds = submit.add_subparsers(dest="action", metavar="KIND", required=True)
    export = _sub(
        kinds,
        "export",
        "create an export (CSV of tickets)",
        "Create a WAITING export for --team as --user and print its id. " + PUBLISH_NOTE,
    )
    _add_user(export)
    export.add_argument(
        "--team", metavar="TEAM_ID", type=uuid_arg, required=True, help="the team's id"
    )
    export.add_argument(
        "--scope",
        choices=("TEAM", "MINE"),
        default="TEAM",
        help="TEAM: all the team's tickets (staff only); MINE: tickets the user requested "
        "or is assigned (default: TEAM)",
    )
    export.add_argument(
        "--filters",
        metavar="JSON",
        type=json_arg,
        default={},
        help='export filters (docs/design.md, "Exports"), '
        'e.g. \'{"status": ["OPEN"], "q": "printer"}\'',
    )
    export.add_argument("--json", action="store_true", help="print the new task as JSON")
    export.add_argument("--idempotency-key", metavar="KEY", help=KEY_HELP)
    export.set_defaults(handler=guarded(cmd_submit_export))
    reminder = _sub(
        kinds,
        "reminder",
        "schedule a reminder for a ticket's assignee (staff only)",
        "Create a WAITING reminder for --ticket, due at --run-at, and print its id. "
        + PUBLISH_NOTE,
    )
    _add_user(reminder)
    reminder.add_argument(
        "--team", metavar="TEAM_ID", type=uuid_arg, required=True, help="the team's id"
    )
    reminder.add_argument(
        "--ticket", metavar="TICKET_ID", type=uuid_arg, required=True, help="a ticket of the team"
    )
    reminder.add_argument(
        "--run-at",
        metavar="ISO",
        type=aware_datetime_arg,
        help="not before this time, with a time zone (default: now)",
    )
    reminder.add_argument("--json", action="store_true", help="print the new task as JSON")
    reminder.add_argument("--idempotency-key", metavar="KEY", help=KEY_HELP)
    reminder.set_defaults(handler=guarded(cmd_submit_reminder))


def _register_task_ops(sub: Any) -> None:
    status = _sub(
        sub,
        "status",
        "print a task as JSON",
        "Print the task (status, run, attempts, progress, last_error, ...) as JSON. "
        "With --user, as that user may see it (else: not found); without, the operator's "
        "view of the row, read by id with no authorisation check.",
    )
    status.add_argument("id", metavar="ID", type=uuid_arg, help="task id")
    _add_user(status, required=False, extra="; default: operator view")
    status.set_defaults(handler=guarded(cmd_status))
    retry = _sub(
        sub,
        "retry",
        "start a new run of a FAILED or CANCELLED task",
        "Open the next run (WAITING) of a FAILED or CANCELLED task, as --user. " + PUBLISH_NOTE,
    )
    retry.add_argument("id", metavar="ID", type=uuid_arg, help="task id")
    _add_user(retry)
    retry.add_argument("--idempotency-key", metavar="KEY", help=KEY_HELP)
    retry.set_defaults(handler=guarded(cmd_retry))
    cancel = _sub(
        sub,
        "cancel",
        "cancel a WAITING or RUNNING task",
        "Cancel a WAITING or RUNNING task as --user. A running execution loses its lease "
        "and stops at its next ledger write; it can never commit a result.",
    )
    cancel.add_argument("id", metavar="ID", type=uuid_arg, help="task id")
    _add_user(cancel)
    cancel.set_defaults(handler=guarded(cmd_cancel))


def _register_token(sub: Any) -> None:
    token = _sub(sub, "token", "manage API tokens", "Manage the API's bearer tokens.")
    actions = token.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = _sub(
        actions,
        "create",
        "create a token for a user and print it once",
        "Create an API token for the user with this email and print it (only its hash is "
        "stored: it cannot be shown again). It expires after --expires-in-days.",
    )
    create.add_argument("email", metavar="EMAIL")
    create.add_argument("--name", metavar="N", help="a label for the token")
    create.add_argument(
        "--expires-in-days",
        metavar="D",
        type=ttl_days_arg,
        default=TOKEN_TTL_DAYS,
        help=f"days until the token expires, 1..{TOKEN_MAX_TTL_DAYS} (default: {TOKEN_TTL_DAYS})",
    )
    create.set_defaults(handler=guarded(cmd_token_create))
    listing = _sub(
        actions,
        "list",
        "list a user's tokens (never their secrets)",
        "List the tokens of the user with this email, oldest first: id, name, created, last "
        "used (recorded at most once a minute), expiry and state (active, expired or "
        "revoked). Neither the token nor its hash is shown.",
    )
    listing.add_argument("email", metavar="EMAIL")
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    listing.set_defaults(handler=guarded(cmd_token_list))
    revoke = _sub(
        actions,
        "revoke",
        "revoke a token at once",
        "Revoke the token with this id (from `token list`): its next request answers 401. "
        "Revoking a revoked token changes nothing.",
    )
    revoke.add_argument("id", metavar="ID", type=uuid_arg, help="token id")
    revoke.set_defaults(handler=guarded(cmd_token_revoke))


def register(sub: Any) -> None:
    _register_submit(sub)
    _register_task_ops(sub)
    _register_token(sub)
