"""deploy/Dockerfile and .dockerignore, checked offline (no Docker engine builds anything).

The image's operational points (the python:3.11-slim base, a non-root final stage, an
exec-form CMD that runs the worker on every task queue and no other, STOPSIGNAL SIGTERM,
the project installed with ``pip install .``) and what the build context leaves out
(.git, .venv, .env) are checked on the parsed files by ``*_problems`` functions, and
every check is shown to fail on a copy of the file broken in exactly that point.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable

import pytest

from tests.support.deploy_files import (
    DEPLOY,
    ROOT,
    flag_value,
    is_exec_form,
    runs_celery,
    unconsumed_queues,
    unknown_queues,
)

DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buffer):
            continue
        if line.endswith("\\"):
            buffer += line[:-1].strip() + " "
            continue
        buffer += line
        keyword, _, args = buffer.strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        buffer = ""
    return result


def _exec_form(args: str) -> list[str] | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def dockerfile_problems(text: str) -> list[str]:
    problems: list[str] = []
    instructions = dockerfile_instructions(text)
    froms = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    if not froms:
        return ["no FROM"]
    for i in froms:
        image = instructions[i][1].split()[0]
        if image != "python:3.11-slim":
            problems.append(f"FROM {image}: expected python:3.11-slim")
    final = instructions[froms[-1] :]

    users = [args for kw, args in final if kw == "USER"]
    if not users:
        problems.append("final stage has no USER (runs as root)")
    elif users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"final stage runs as USER {users[-1]}")

    cmds = [args for kw, args in final if kw == "CMD"]
    entrypoints = [args for kw, args in final if kw == "ENTRYPOINT"]
    if not cmds:
        problems.append("no CMD")
    else:
        cmd = _exec_form(cmds[-1])
        if cmd is None or not is_exec_form(cmd):
            problems.append(f"CMD is not exec form: {cmds[-1]}")
        elif not (runs_celery(cmd, "worker") and flag_value(cmd, "-A", "--app") == "tasks"):
            problems.append(f"default CMD is not the worker: {cmd}")
        elif unconsumed := unconsumed_queues([cmd]):
            problems.append(f"default CMD does not consume queue(s) {unconsumed}")
        elif unknown := unknown_queues(cmd):
            problems.append(f"default CMD names undeclared queue(s) {unknown}")
    if entrypoints:
        entry = _exec_form(entrypoints[-1])
        if entry is None or (entry and not is_exec_form(entry)):
            problems.append(f"ENTRYPOINT is not exec form: {entrypoints[-1]}")

    stops = [args for kw, args in final if kw == "STOPSIGNAL"]
    if not stops or stops[-1] not in ("SIGTERM", "15"):
        problems.append("STOPSIGNAL SIGTERM missing")

    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    install = re.search(r"pip install ((?:[^&;|]* )?)\.(?:\s|$)", runs)
    if not install:
        problems.append("the project is not installed with `pip install .`")
    elif not re.search(r"(?:^|\s)(?:-c|--constraint)[ =]constraints\.txt(?:\s|$)", install[1]):
        problems.append("`pip install .` does not use -c constraints.txt (the pinned versions)")
    return problems


def pinned(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file, by normalised name."""
    found = re.findall(r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


def constraints_problems(pyproject: str, constraints: str) -> list[str]:
    """Every dependency of pyproject.toml (with its extras) is pinned in constraints.txt."""
    project = tomllib.loads(pyproject)["project"]
    wanted = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        wanted += extra
    pins = pinned(constraints)
    names = {
        re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]).lower()
        for req in wanted
    }
    return [f"constraints.txt does not pin {name}" for name in sorted(names - pins.keys())]


def dockerignore_patterns(text: str) -> set[str]:
    return {
        line.strip().rstrip("/")
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    }


def dockerignore_problems(text: str) -> list[str]:
    patterns = dockerignore_patterns(text)
    return [
        f".dockerignore does not exclude {p}"
        for p in (".git", ".venv", ".env")
        if p not in patterns
    ]


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


# --------------------------------------------------------------------------- Dockerfile tests


def test_dockerfile_points(dockerfile_text: str) -> None:
    assert dockerfile_problems(dockerfile_text) == []


def test_dockerignore_keeps_secrets_and_local_state_out() -> None:
    assert dockerignore_problems(DOCKERIGNORE.read_text()) == []


DOCKERFILE_BREAKS: list[tuple[str, Callable[[str], str], str]] = [
    ("no USER", lambda t: re.sub(r"(?m)^USER .*$", "", t), "no USER"),
    ("USER root", lambda t: re.sub(r"(?m)^USER .*$", "USER root", t), "runs as USER root"),
    (
        "shell-form CMD",
        lambda t: re.sub(r"(?m)^CMD .*$", "CMD celery -A tasks worker", t),
        "CMD is not exec form",
    ),
    (
        "sh -c wrapper",
        lambda t: re.sub(r"(?m)^CMD .*$", 'CMD ["sh", "-c", "celery -A tasks worker"]', t),
        "CMD is not exec form",
    ),
    (
        "CMD not worker",
        lambda t: re.sub(r"(?m)^CMD .*$", 'CMD ["celery", "-A", "tasks", "beat"]', t),
        "default CMD is not the worker",
    ),
    (
        "shell ENTRYPOINT",
        lambda t: t + "\nENTRYPOINT /bin/sh -c start\n",
        "ENTRYPOINT is not exec form",
    ),
    ("no STOPSIGNAL", lambda t: re.sub(r"(?m)^STOPSIGNAL .*$", "", t), "STOPSIGNAL"),
    (
        "other base",
        lambda t: t.replace("python:3.11-slim", "python:3.11", 1),
        "expected python:3.11-slim",
    ),
    (
        "CMD without reminders",
        lambda t: t.replace('"exports,reminders"', '"exports"'),
        "default CMD does not consume queue(s) ['reminders']",
    ),
    (
        "CMD with the old maintenance queue",
        lambda t: t.replace('"exports,reminders"', '"exports,reminders,maintenance"'),
        "default CMD names undeclared queue(s) ['maintenance']",
    ),
    (
        "no pip install .",
        lambda t: t.replace("pip install -c constraints.txt .", "pip install teamdesk-tasks"),
        "pip install .",
    ),
    (
        "no constraints",
        lambda t: t.replace("pip install -c constraints.txt .", "pip install ."),
        "does not use -c constraints.txt",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in DOCKERFILE_BREAKS],
    ids=[name for name, _, _ in DOCKERFILE_BREAKS],
)
def test_dockerfile_checks_catch_a_broken_file(
    dockerfile_text: str, mutate: Callable[[str], str], expected: str
) -> None:
    broken = mutate(dockerfile_text)
    assert broken != dockerfile_text
    assert any(expected in p for p in dockerfile_problems(broken)), dockerfile_problems(broken)


def test_dockerignore_check_catches_a_missing_pattern() -> None:
    text = DOCKERIGNORE.read_text()
    broken = re.sub(r"(?m)^\.env$", "", text)
    assert broken != text
    assert dockerignore_problems(broken) == [".dockerignore does not exclude .env"]


# --------------------------------------------------------------------------- constraints.txt


def test_constraints_pin_every_dependency_and_the_build_context_keeps_them() -> None:
    constraints = (ROOT / "constraints.txt").read_text()
    assert constraints_problems((ROOT / "pyproject.toml").read_text(), constraints) == []
    assert "constraints.txt" not in dockerignore_patterns(DOCKERIGNORE.read_text())
    assert "pip-compile" in constraints  # generated, not edited by hand (make constraints)


def test_constraints_check_catches_a_missing_pin() -> None:
    constraints = (ROOT / "constraints.txt").read_text()
    broken = re.sub(r"(?m)^celery==.*$", "", constraints)
    assert broken != constraints
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert constraints_problems(pyproject, broken) == ["constraints.txt does not pin celery"]


def test_make_install_uses_the_constraints_too() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'" in makefile
    assert re.search(r"(?m)^\$\(STAMP\): pyproject\.toml constraints\.txt ", makefile)
