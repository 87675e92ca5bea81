"""``teamdesk-tasks api``: serve the HTTP API (``api.app:app``) with uvicorn.

Logs are the project's JSON lines (service ``api``): uvicorn's own logging setup is
turned off (``log_config=None``) so its records reach our root handler. SIGTERM or
Ctrl-C stops it gracefully (requests in flight finish) and the process exits 0; a
server that cannot start (port taken, app not importable) exits non-zero.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Any

from cli.commands.common import port_arg
from teamdesk.config import ConfigError, settings_or_exit, trusted_proxies
from teamdesk.logs import setup_logging

APP = "api.app:app"


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """Receives the signal uvicorn re-raises after its graceful shutdown.

    uvicorn handles SIGTERM/SIGINT itself, then restores the previous handlers and raises
    the signal again so the process ends "as if" killed by it (exit 143 / 130). A stop
    that ended cleanly should exit 0, so the previous handler is this no-op."""


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from teamdesk import s3_store

    # FORWARDED_ALLOW_IPS names the proxies whose X-Forwarded-For is believed; the app
    # reads it (api/middleware.py, ForwardedClient), uvicorn's own handling is off. '*' or
    # a network of every address stops the start: with either, a client could pick the
    # address its failed authentications are counted against (escape the limit, or aim it
    # at someone else). So does an entry that is not an address (a typo trusts nobody).
    try:
        trusted_proxies()
    except ConfigError as exc:
        print(f"teamdesk-tasks api: {exc}", file=sys.stderr)
        return 2
    settings = settings_or_exit()
    s3_store.store_or_exit(settings, "teamdesk-tasks api")  # downloads read EXPORT_STORE
    setup_logging("api", settings.log_level)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    # No "server: uvicorn" header: it tells a scanner what to try.
    uvicorn.run(
        APP,
        host=args.host,
        port=args.port,
        log_config=None,
        server_header=False,
        proxy_headers=False,
    )
    return 0


def register(sub: Any) -> None:
    api = sub.add_parser(
        "api",
        help="serve the HTTP API with uvicorn",
        description="Serve the HTTP API (health, tasks, CSV download) with uvicorn, logging "
        "JSON lines (service api). SIGTERM or Ctrl-C stops it gracefully (exit 0).",
    )
    api.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    api.add_argument(
        "--port", type=port_arg, default=8000, help="port to listen on (default: 8000)"
    )
    api.set_defaults(handler=cmd_api)
