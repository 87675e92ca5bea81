"""Celery's entry point: ``celery -A tasks ...`` imports this module and uses ``app``.

Only Celery imports it (the rest of the code builds apps with
:func:`tasks.celery_app.create_app`). Building the app here reads and validates the
configuration (one clear line and exit code 2 when it is bad), starts JSON logging from
the first line (Celery warns before its own log setup), loads the test hooks named by
``TEAMDESK_TEST_HOOKS`` (unset in production) and, for ``run-local --slow-exports`` only,
the demo's export pause (tasks/demo_pause.py; off unless its variable is set).
"""

from __future__ import annotations

from tasks import demo_pause
from tasks.celery_app import create_app, service_name
from teamdesk import hooks
from teamdesk.config import settings_or_exit
from teamdesk.logs import setup_logging

settings = settings_or_exit()
setup_logging(service_name(), settings.log_level)
app = create_app(settings)
hooks.load_from_env()
demo_pause.install_from_env()
