"""``teamdesk-tasks api``: serve ``api.app:app`` with uvicorn, logging our JSON lines
(``log_config=None``); a graceful stop on SIGTERM or Ctrl-C exits 0.
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
    """Receives the signal uvicorn re-raises after its graceful shutdown (which would
    otherwise exit 143 / 130): a clean stop exits 0."""


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from teamdesk import s3_store

    # A FORWARDED_ALLOW_IPS that trusts every address, or is not one, stops the start:
    # a client could pick the address its failed authentications count against.
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
