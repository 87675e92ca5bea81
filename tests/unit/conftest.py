"""Fixtures shared by the unit tests: the parsed deploy/compose.yaml, for the compose
checks and the compose schema checks (tests/unit/test_deploy_compose*.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.deploy_files import COMPOSE_FILE


@pytest.fixture(scope="module")
def compose_doc() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc
