"""Celery entry point: ``celery -A tasks worker|beat|flower`` finds ``tasks.app``."""

from tasks.app import create_app
from teamdesk.config import settings_or_exit

app = create_app(settings_or_exit())

__all__ = ["app"]
