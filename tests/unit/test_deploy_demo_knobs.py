"""Demo-only knobs never reach a deployment: no file under deploy/ sets the slow-export
pause (tasks/demo_pause.py) or the test hook-point seam."""

from __future__ import annotations

from tests.support.deploy_files import DEPLOY

DEMO_ONLY = ("TEAMDESK_DEMO_SLOW_EXPORT_S", "TEAMDESK_TEST_HOOKS")


def demo_knob_problems(files: dict[str, str]) -> list[str]:
    return [
        f"{name} sets {knob}" for name, text in files.items() for knob in DEMO_ONLY if knob in text
    ]


def deploy_files() -> dict[str, str]:
    return {str(p.relative_to(DEPLOY)): p.read_text() for p in DEPLOY.rglob("*") if p.is_file()}


def test_no_deployment_file_sets_a_demo_knob() -> None:
    files = deploy_files()
    assert "compose.yaml" in files and "k8s/worker.yaml" in files
    assert demo_knob_problems(files) == []


def test_the_check_catches_a_demo_knob() -> None:
    broken = {"k8s/configmap.yaml": "data:\n  TEAMDESK_DEMO_SLOW_EXPORT_S: '2'\n"}
    assert demo_knob_problems(broken) == ["k8s/configmap.yaml sets TEAMDESK_DEMO_SLOW_EXPORT_S"]
