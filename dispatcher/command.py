"""``teamdesk-tasks scan``: one dispatcher scan from the command line (docs/design.md,
"Dispatch"); exit 1 with one line on stderr when PostgreSQL or Redis cannot be reached.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from dispatcher.errors import ScanUnavailable
from dispatcher.scan import run_once
from tasks.celery_app import create_app
from teamdesk.config import Settings
from teamdesk.failures import DATABASE_HINT, database_unusable

_HINTS = {
    "PostgreSQL": DATABASE_HINT,
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
        return _unavailable(err, exc)
    finally:
        app.close()
    print(json.dumps(counts.as_dict()) if as_json else counts.summary(), file=out)
    if counts.redis_error:
        return _unreachable(err, "Redis", counts.redis_error)
    return 0


def _unreachable(err: TextIO, service: str, error: str) -> int:
    print(f"teamdesk-tasks scan: cannot reach {service} ({error}); {_HINTS[service]}", file=err)
    return 1


def _unavailable(err: TextIO, exc: ScanUnavailable) -> int:
    """The scan's PostgreSQL error, with its cause (the driver's error it was raised from)."""
    if exc.service != "PostgreSQL" or exc.__cause__ is None:
        return _unreachable(err, exc.service, exc.error)
    print(f"teamdesk-tasks scan: {database_unusable(exc.__cause__)}", file=err)
    return 1
