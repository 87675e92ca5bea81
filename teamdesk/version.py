"""The running version, for ``--version``, ``/api/health`` and start lines (docs/design.md,
"Logs"): the installed metadata (reinstall after changing pyproject.toml), else a source
tree's pyproject.toml, else :data:`UNKNOWN`, never a reason not to start. A leaf module.
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
