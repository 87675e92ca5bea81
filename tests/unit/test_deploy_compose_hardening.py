"""deploy/compose.yaml's containers hardened like the Kubernetes pods (their
``securityContext``), checked offline on the parsed file, for every service:

- no Linux capability (``cap_drop: [ALL]``, none added back), no privilege gained through
  a setuid binary (``no-new-privileges:true``), never ``privileged``;
- a read-only root filesystem, with a ``tmpfs`` at each directory the service writes
  (the TeamDesk processes: /tmp; PostgreSQL: its socket directory; Redis: /tmp, where its
  start script writes the users file);
- PostgreSQL and Redis run as their images' own users: their entrypoints would otherwise
  start as root and need CHOWN and SETUID to step down, which ``cap_drop: [ALL]`` takes;
  no service runs as root;
- Redis is an exact version of a release line that has the Lua fixes of October 2025
  (CVE-2025-49844 and its siblings: 7.2.11, 7.4.6, 8.0.4, 8.2.2), never a floating tag.

Every check is shown to fail on a copy broken in exactly that point. Who holds which
password (Redis's as files, none in its environment): test_deploy_access.py.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

# The directories each service writes outside its volumes (a tmpfs each).
WRITABLE = {
    "postgres": ("/var/run/postgresql", "/tmp"),
    "redis": ("/tmp",),
    **{name: ("/tmp",) for name in ("migrate", "api", "worker", "beat", "flower")},
}
# Images whose entrypoint steps down from root (gosu): run them as that user instead.
IMAGE_USER = {"postgres": "postgres", "redis": "redis"}
ROOT = {"0", "root", "0:0", "root:root"}
# The first release of each line with the fixes of CVE-2025-49844, -46817, -46818, -46819.
PATCHED = {(7, 2): (7, 2, 11), (7, 4): (7, 4, 6), (8, 0): (8, 0, 4), (8, 2): (8, 2, 2)}
REDIS_TAG = re.compile(r"redis:(\d+)\.(\d+)\.(\d+)(-[a-z0-9.]+)?")


def _tmpfs_paths(svc: dict[str, Any]) -> set[str]:
    tmpfs = svc.get("tmpfs") or []
    entries = [tmpfs] if isinstance(tmpfs, str) else tmpfs
    return {str(entry).split(":", 1)[0] for entry in entries}


def _privilege_problems(name: str, svc: dict[str, Any]) -> list[str]:
    problems = []
    if svc.get("cap_drop") != ["ALL"]:
        problems.append(f"{name}: cap_drop is {svc.get('cap_drop')!r}, not [ALL]")
    if svc.get("cap_add"):
        problems.append(f"{name}: adds capabilities {svc['cap_add']}")
    if "no-new-privileges:true" not in (svc.get("security_opt") or []):
        problems.append(f"{name}: no security_opt no-new-privileges:true")
    if svc.get("privileged"):
        problems.append(f"{name}: privileged")
    return problems


def _filesystem_problems(name: str, svc: dict[str, Any]) -> list[str]:
    problems = []
    if svc.get("read_only") is not True:
        problems.append(f"{name}: the root filesystem is not read-only")
    missing = sorted(set(WRITABLE.get(name, ())) - _tmpfs_paths(svc))
    if missing:
        problems.append(f"{name}: no tmpfs at {', '.join(missing)}, where it writes")
    return problems


def _user_problems(name: str, svc: dict[str, Any]) -> list[str]:
    user = str(svc.get("user", ""))
    if user in ROOT:
        return [f"{name}: runs as root"]
    if name in IMAGE_USER and user != IMAGE_USER[name]:
        return [f"{name}: runs as {user or 'the image default (root)'}, not {IMAGE_USER[name]}"]
    return []


def redis_image_problem(image: str) -> str | None:
    match = REDIS_TAG.fullmatch(image)
    if match is None:
        return f"redis: image {image} is not pinned to an exact version"
    major, minor, patch = (int(part) for part in match.groups()[:3])
    version = (major, minor, patch)
    fixed = PATCHED.get((major, minor))
    if fixed is None or version < fixed:
        return f"redis: image {image} lacks the Lua fixes (CVE-2025-49844)"
    return None


def hardening_problems(doc: dict[str, Any]) -> list[str]:
    problems = []
    for name, svc in doc["services"].items():
        problems += _privilege_problems(name, svc)
        problems += _filesystem_problems(name, svc)
        problems += _user_problems(name, svc)
    if problem := redis_image_problem(str(doc["services"]["redis"].get("image", ""))):
        problems.append(problem)
    return problems


def test_every_service_is_hardened(compose_doc: dict[str, Any]) -> None:
    assert set(WRITABLE) == set(compose_doc["services"])  # a new service needs its entry
    assert hardening_problems(compose_doc) == []


def _set(service: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][service][key] = value

    return mutate


def _drop(service: str, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][service].pop(key, None)

    return mutate


BREAKS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("worker keeps its capabilities", _drop("worker", "cap_drop"), "worker: cap_drop is None"),
    ("redis adds one back", _set("redis", "cap_add", ["CHOWN"]), "redis: adds capabilities"),
    ("api may gain privileges", _drop("api", "security_opt"), "api: no security_opt"),
    ("flower privileged", _set("flower", "privileged", True), "flower: privileged"),
    ("beat writable", _set("beat", "read_only", False), "beat: the root filesystem is not"),
    ("migrate without /tmp", _drop("migrate", "tmpfs"), "migrate: no tmpfs at /tmp"),
    (
        "postgres without its socket directory",
        _set("postgres", "tmpfs", ["/tmp"]),
        "postgres: no tmpfs at /var/run/postgresql",
    ),
    ("postgres as root", _drop("postgres", "user"), "postgres: runs as the image default"),
    ("worker as root", _set("worker", "user", "0"), "worker: runs as root"),
    ("redis floating", _set("redis", "image", "redis:7-bookworm"), "is not pinned"),
    ("redis unpatched", _set("redis", "image", "redis:7.4.5-bookworm"), "lacks the Lua fixes"),
    ("redis 7.0", _set("redis", "image", "redis:7.0.15"), "lacks the Lua fixes"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [(m, e) for _, m, e in BREAKS], ids=[name for name, _, _ in BREAKS]
)
def test_the_hardening_checks_catch_a_broken_file(
    compose_doc: dict[str, Any], mutate: Callable[[dict[str, Any]], None], expected: str
) -> None:
    broken = copy.deepcopy(compose_doc)
    mutate(broken)
    problems = hardening_problems(broken)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("image", "patched"),
    [
        ("redis:7.4.6-bookworm", True),
        ("redis:7.2.11", True),
        ("redis:8.2.2-alpine", True),
        ("redis:7.2.10-bookworm", False),
        ("redis:8.2.1", False),
        ("redis:7.4", False),
        ("redis:latest", False),
    ],
)
def test_the_image_check_knows_the_patched_releases(image: str, patched: bool) -> None:
    assert (redis_image_problem(image) is None) == patched
