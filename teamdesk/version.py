"""The version of the running code, in one place: ``teamdesk-tasks --version``,
``GET /api/health`` and the start lines of the worker and beat all ask :func:`version`.

The installed distribution's metadata says it (``pip install`` and ``pip install -e``
both write it from pyproject.toml's ``version``; after changing that line, reinstall:
``make install`` does). Run from a source tree that was never installed, there is no
metadata: the tree's own pyproject.toml says it then, if it is this project's. Neither:
:data:`UNKNOWN`. The version is reported, never relied on, so no process refuses to start
for want of it. A leaf: imports nothing of ours. Importing it costs ~25 ms
(importlib.metadata), so the CLI imports it only for ``--version``.
"""

from __future__ import annotations

import functools
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

DISTRIBUTION = "teamdesk-tasks"  # [project] name in pyproject.toml
UNKNOWN = "unknown"
# In a source tree, next to the packages; in site-packages there is none (or not ours).
SOURCE_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def version() -> str:
    """The running version, e.g. ``"1.0.0"``; read once per process."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return source_version(SOURCE_PYPROJECT)


def source_version(pyproject: Path) -> str:
    """``[project] version`` of this project's pyproject.toml; :data:`UNKNOWN` when the
    file is missing or unreadable, names another project or has no static version."""
    try:
        project: Any = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return UNKNOWN
    if not isinstance(project, dict) or project.get("name") != DISTRIBUTION:
        return UNKNOWN
    found = project.get("version")
    return found if isinstance(found, str) and found else UNKNOWN
