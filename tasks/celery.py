"""Celery's entry point: ``celery -A tasks ...`` imports this module and uses ``app``.

Only Celery imports it (the rest of the code builds apps with
:func:`tasks.celery_app.create_app`). Building the app here reads and validates the
configuration (one clear line and exit code 2 when it is bad), starts JSON logging from
the first line (Celery warns before its own log setup), and loads the test hooks named
by ``TEAMDESK_TEST_HOOKS`` (unset in production).
"""

from __future__ import annotations

from tasks.celery_app import create_app, service_name
from teamdesk import hooks
from teamdesk.config import settings_or_exit
from teamdesk.logs import setup_logging

settings = settings_or_exit()
setup_logging(service_name(), settings.log_level)
app = create_app(settings)
hooks.load_from_env()
