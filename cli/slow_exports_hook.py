"""Loaded by ``run-local``'s workers when ``--slow-exports`` is on (demo only): installs
the pause of cli/slow_exports.py. Importing it is the whole effect."""

from __future__ import annotations

from cli.slow_exports import install_from_env

install_from_env()
