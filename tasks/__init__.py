"""Celery entry point: ``celery -A tasks worker|beat|flower`` finds ``tasks.app``.

The app is built on first access (module ``__getattr__``), not at import, so importing
any ``tasks.*`` module (the dispatcher does) never builds an app as a side effect.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_app: Any = None


def _default_app() -> Any:
    global _app
    with _lock:
        if _app is None:
            from tasks.celery_app import create_app, service_name
            from teamdesk import hooks
            from teamdesk.config import settings_or_exit
            from teamdesk.logs import setup_logging

            settings = settings_or_exit()
            # JSON logs from the first line on (Celery warns before its own log setup).
            setup_logging(service_name(), settings.log_level)
            _app = create_app(settings)
            hooks.load_from_env()
        return _app


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        return _default_app()
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")
