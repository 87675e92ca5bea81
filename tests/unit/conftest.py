"""Fixtures shared by the unit tests: the parsed deploy/compose.yaml (for the compose
checks, the compose schema checks and the access checks, tests/unit/test_deploy_*.py) and
the parsed deploy/k8s/ documents (the Kubernetes, access and network checks)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.deploy_files import COMPOSE_FILE, k8s_documents


@pytest.fixture(scope="module")
def compose_doc() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict[str, Any]]:
    return k8s_documents()
