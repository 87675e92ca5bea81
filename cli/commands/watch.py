"""``teamdesk-tasks watch ID``: follow a task in the ledger until it ends (exit codes in
the parser's epilog); one line redrawn on a terminal, a line per change otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from cli.commands.common import guarded, positive_float_arg, say_error, uuid_arg
from teamdesk.failures import database_unusable

EXIT_TIMEOUT = 3
ENDS = {"COMPLETED": 0, "FAILED": 1, "CANCELLED": 1}
BAR_WIDTH = 10
WAITING_STEP_S = 5

View = dict[str, Any]


def progress_line(view: View) -> str:
    """``[#####.....] 50% RUNNING run 0 attempt 1``, with ``- waiting 60 s: <reason>`` for
    a late task (seconds in steps of :data:`WAITING_STEP_S`, so a log gets a line per step)."""
    percent = max(0, min(100, int(view["progress"])))
    filled = percent * BAR_WIDTH // 100
    line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {percent}% {view['status']}"
    line += f" run {int(view['run'])}"
    if view.get("attempts"):
        line += f" attempt {view['attempts']}"
    from api.cluster import waiting_line

    waiting = waiting_line(view, WAITING_STEP_S)
    return line + (f" - {waiting}" if waiting else "")


class Screen:
    """Redraws one line on a terminal; prints each new line elsewhere."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.last: str | None = None

    def show(self, line: str) -> None:
        if line == self.last:
            return
        if self.tty:
            self.out.write(f"\r{line}\x1b[K")
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self.last = line

    def close(self) -> None:
        if self.tty and self.last is not None:
            self.out.write("\n")
            self.out.flush()


def _report_end(view: View, out: TextIO, err: TextIO) -> int:
    status = view["status"]
    if status == "COMPLETED":
        if view.get("result_summary"):
            print(f"result: {view['result_summary']}", file=out)
    else:
        reason = view.get("last_error")
        print(f"task {status}" + (f": {reason}" if reason else ""), file=err)
    return ENDS[status]


def follow(
    read: Callable[[], View | None],
    *,
    interval: float,
    timeout: float | None,
    out: TextIO,
    err: TextIO,
    tty: bool,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll ``read`` (None = could not read this time) until the task ends or time is up."""
    deadline = None if timeout is None else clock() + timeout
    screen = Screen(out, tty)
    last: View | None = None
    while True:
        view = read()
        if view is not None:
            last = view
            screen.show(progress_line(view))
            if view["status"] in ENDS:
                screen.close()
                return _report_end(view, out, err)
        if deadline is not None and clock() >= deadline:
            screen.close()
            state = last["status"] if last else "unknown"
            print(f"timed out after {timeout:g} s; the task is still {state}", file=err)
            return EXIT_TIMEOUT
        sleep(interval)


def _reader(args: argparse.Namespace) -> Callable[[], View | None]:
    """Reads the task; after a first good read, a lost database is reported once and
    retried (the task goes on without us), never a traceback."""
    from sqlalchemy import exc as sa_exc

    from cli.commands.task_commands import explained, read_view
    from teamdesk.db import get_engine

    engine = get_engine()
    state = {"read_once": False, "warned": False}

    def read() -> View | None:
        try:
            with engine.connect() as conn:
                view = explained(read_view(conn, args.id, args.user))
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            if not state["read_once"]:
                raise
            if not state["warned"]:
                say_error(args, database_unusable(exc) + "; still trying")
                state["warned"] = True
            return None
        state["read_once"], state["warned"] = True, False
        return view

    return read


def cmd_watch(args: argparse.Namespace) -> int:
    read = _reader(args)
    try:
        return follow(
            read,
            interval=args.interval,
            timeout=args.timeout,
            out=sys.stdout,
            err=sys.stderr,
            tty=sys.stdout.isatty(),
        )
    except KeyboardInterrupt:
        print(file=sys.stdout)
        return 130


def register(sub: Any) -> None:
    watch = sub.add_parser(
        "watch",
        help="follow a task's progress until it ends (exit 0 COMPLETED, 1 FAILED/CANCELLED)",
        description="Follow a task until it ends: a live progress bar on a terminal, one "
        "line per change otherwise. Without --user, the operator's view of the row.",
        epilog="exit status: 0 COMPLETED; 1 FAILED or CANCELLED (last_error on stderr), not "
        "found, or PostgreSQL unreachable at the first read; 2 invalid arguments; "
        "3 --timeout passed before the task ended",
    )
    watch.add_argument("id", metavar="ID", type=uuid_arg, help="task id")
    watch.add_argument("--user", metavar="EMAIL", help="watch as this user (default: operator)")
    watch.add_argument(
        "--interval",
        metavar="S",
        type=positive_float_arg,
        default=1.0,
        help="seconds between reads of the ledger (default: 1)",
    )
    watch.add_argument(
        "--timeout",
        metavar="S",
        type=positive_float_arg,
        help="give up after this many seconds (exit 3); default: wait until it ends",
    )
    watch.set_defaults(handler=guarded(cmd_watch))
