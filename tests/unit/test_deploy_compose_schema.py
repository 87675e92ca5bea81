"""deploy/compose.yaml validated as a Compose file, offline (no Docker engine runs here).

The file is validated against the Compose Specification JSON schema that
check-jsonschema vendors (``--builtin-schema vendor.compose-spec``; no download), and
the check is shown to reject a broken copy; when the ``docker`` CLI has the compose
plugin, ``docker compose config -q`` also validates the file (no engine needed);
otherwise that one test is skipped.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.deploy_files import COMPOSE_FILE


def _check_jsonschema_compose(path: Path) -> subprocess.CompletedProcess[str]:
    # The builtin schema ships inside the check-jsonschema wheel: nothing is downloaded.
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_compose_file_matches_the_compose_specification_schema() -> None:
    result = _check_jsonschema_compose(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_check_rejects_an_invalid_file(
    compose_doc: dict[str, Any], tmp_path: Path
) -> None:
    broken = copy.deepcopy(compose_doc)
    broken["services"]["worker"]["stop_grace_periode"] = "90s"  # unknown key
    broken["services"]["beat"]["restart"] = ["always"]  # wrong type
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_jsonschema_compose(path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stop_grace_periode" in result.stdout + result.stderr


@cache
def _docker_compose_works() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        result = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _docker_compose_config(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("FLOWER_", "POSTGRES_", "REDIS_", "APP_DB_", "COMPOSE_", "DOCKER_HOST")
        )
    }
    return subprocess.run(
        ["docker", "compose", "--env-file", str(env_file), "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, **env},
    )


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    if not _docker_compose_works():
        pytest.skip("docker CLI with the compose plugin not available")
    required = {
        "POSTGRES_PASSWORD": "pw",
        "APP_DB_PASSWORD": "app",
        "API_DB_PASSWORD": "api",
        "REDIS_PASSWORD": "rp",
        "REDIS_API_PASSWORD": "ra",
        "REDIS_WORKER_PASSWORD": "rw",
        "REDIS_BEAT_PASSWORD": "rb",
        "REDIS_FLOWER_PASSWORD": "rf",
        "FLOWER_USER": "u",
        "FLOWER_PASSWORD": "p",
    }
    result = _docker_compose_config(tmp_path, required)
    assert result.returncode == 0, result.stderr
    for name in required:
        missing = _docker_compose_config(tmp_path, {k: v for k, v in required.items() if k != name})
        assert missing.returncode != 0
        assert name in missing.stderr
