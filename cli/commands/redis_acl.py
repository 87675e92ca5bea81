"""``teamdesk-tasks redis-acl``: print the Redis users of teamdesk/redis_acl.py as an ACL
file or ``ACL SETUSER`` commands (docs/design.md, "Processes"). Passwords are printed only
as their SHA-256; a ``--placeholders`` file does not load until they are replaced.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from teamdesk.config import settings_or_exit
from teamdesk.redis_acl import (
    ADMIN,
    COMPONENTS,
    PASSWORD_VARS,
    Layout,
    acl_file_line,
    password_hash,
    placeholder,
    setuser_line,
)

FORMATS = ("acl-file", "setuser")


def cmd_redis_acl(args: argparse.Namespace) -> int:
    from tasks.names import TASK_QUEUES

    settings = settings_or_exit()
    try:
        layout = Layout(settings.queue_prefix, tuple(TASK_QUEUES), args.db)
    except ValueError as exc:
        print(f"teamdesk-tasks redis-acl: {exc}", file=sys.stderr)
        return 2
    every = (ADMIN, *COMPONENTS) if args.format == "acl-file" else COMPONENTS
    roles = args.role or every
    hashes = {}
    for role in roles:
        password = os.environ.get(PASSWORD_VARS[role]) or ""
        if not password and not args.placeholders:
            print(
                f"teamdesk-tasks redis-acl: set {PASSWORD_VARS[role]} (the {role} user's "
                "password), or print placeholders with --placeholders",
                file=sys.stderr,
            )
            return 2
        hashes[role] = placeholder(role) if args.placeholders else password_hash(password)
    render = acl_file_line if args.format == "acl-file" else setuser_line
    for role in roles:
        print(render(role, layout, hashes[role]))
    return 0


def _db_number(text: str) -> int:
    if not text.isdigit() or int(text) > 15:
        raise argparse.ArgumentTypeError("a Redis database number, 0 to 15")
    return int(text)


def register(sub: Any) -> None:
    acl = sub.add_parser(
        "redis-acl",
        help="print the Redis ACL users of the api, worker, beat and flower roles",
        description="Print one Redis user per process role, each allowed only the keys, "
        "channels and commands its processes use (key patterns from QUEUE_PREFIX): as "
        "ACL file lines (default; the administrator 'default' first: an ACL file replaces "
        "every user) or as ACL SETUSER commands for redis-cli. Loading them again replaces "
        "the users' rules (each starts with 'reset').",
        epilog="Passwords from REDIS_API_PASSWORD, REDIS_WORKER_PASSWORD, "
        "REDIS_BEAT_PASSWORD, REDIS_FLOWER_PASSWORD and (the administrator) REDIS_PASSWORD; "
        "printed as their SHA-256 only. Users are named <QUEUE_PREFIX>-<role>.",
    )
    acl.add_argument(
        "--role",
        action="append",
        choices=(ADMIN, *COMPONENTS),
        help="only this role's user (repeatable; default: every role, and 'default' in an "
        "ACL file)",
    )
    acl.add_argument(
        "--format", choices=FORMATS, default="acl-file", help="acl-file (default) or setuser"
    )
    acl.add_argument(
        "--db",
        type=_db_number,
        default=0,
        help="the broker's Redis database number, part of Celery's channel names (default 0)",
    )
    acl.add_argument(
        "--placeholders",
        action="store_true",
        help="print a placeholder instead of each password's hash (an example file)",
    )
    acl.set_defaults(handler=cmd_redis_acl)
