"""Celery's entry point, ``celery -A tasks ...``; only Celery imports it (the rest of the
code calls :func:`tasks.celery_app.create_app`). Logging starts before the app is built,
since Celery warns before its own log setup.
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
