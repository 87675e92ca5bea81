"""``teamdesk-tasks scan``: one dispatcher scan from the command line (docs/design.md,
"Dispatch"): recover, re-publish lost messages, fill the window, purge.

Prints one line saying what the scan did (or one JSON object with ``--json``) and exits
0; exits 1 with one clear line on stderr when PostgreSQL or Redis (or the broker) cannot
be reached. The line names the service and the error class, never an address.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from dispatcher.errors import ScanUnavailable
from dispatcher.scan import run_once
from tasks.celery_app import create_app
from teamdesk.config import Settings

_HINTS = {
    "PostgreSQL": "check DATABASE_URL and that PostgreSQL is running",
    "Redis": "check REDIS_URL / BROKER_URL and that Redis is running",
}


def scan_command(
    settings: Settings,
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    app = create_app(settings)
    try:
        counts = run_once(app, settings=settings)
    except ScanUnavailable as exc:
        return _unreachable(err, exc.service, exc.error)
    finally:
        app.close()
    print(json.dumps(counts.as_dict()) if as_json else counts.summary(), file=out)
    if counts.redis_error:
        return _unreachable(err, "Redis", counts.redis_error)
    return 0


def _unreachable(err: TextIO, service: str, error: str) -> int:
    print(f"teamdesk-tasks scan: cannot reach {service} ({error}); {_HINTS[service]}", file=err)
    return 1
