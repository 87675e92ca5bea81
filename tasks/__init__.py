"""Celery entry point: ``celery -A tasks worker|beat|flower`` finds ``tasks.app``."""

from tasks.app import create_app
from teamdesk import hooks
from teamdesk.config import settings_or_exit

app = create_app(settings_or_exit())
hooks.load_from_env()

__all__ = ["app"]
