"""Who gets which credential, in deploy/compose.yaml and deploy/k8s/ (deploy/README.md,
"Who gets which secret"), checked offline on the parsed files.

- **Redis requires a password.** Compose starts it with ``--requirepass`` from the
  required ``REDIS_PASSWORD``, and its health check authenticates from the environment;
  every ``REDIS_URL`` (Compose default, Kubernetes Secret) carries a password, and so
  does every ``BROKER_URL`` that is not empty (empty = ``REDIS_URL``).
- **Two database roles.** Migrate alone holds the schema owner's ``DATABASE_URL`` and
  ``APP_DB_PASSWORD`` and sets up the application role (``--app-role teamdesk_app``);
  every other ``DATABASE_URL`` (and a ``DISPATCH_LISTEN_URL``) connects as that role.
- **Each component gets only what it reads** (``NEEDS``): Flower no database URL at all.
  On Kubernetes each pod reads its own Secret only, variable by variable (a Secret is
  never loaded whole with ``envFrom``), and each Secret holds only its component's
  variables; the old shared ``teamdesk-secrets`` is gone.

Every check is shown to fail on a copy broken in exactly that point.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.deploy_files import (
    APP_ROLE,
    COMPONENTS,
    CREDENTIAL_VARS,
    NEEDS,
    argv,
    compose_default,
    containers,
    env_map,
    find,
    main_container,
    migrate_app_role,
    of_kind,
    pod_labels,
    pod_spec,
    url_credentials,
)

# Compose hands Flower its basic auth as one variable, built from FLOWER_USER/PASSWORD.
COMPOSE_NEEDS = {
    **NEEDS,
    "flower": frozenset({"REDIS_URL", "BROKER_URL", "FLOWER_BASIC_AUTH"}),
}
# The schema owner's credentials, in Compose interpolations: migrate's alone.
OWNER_VARS = ("POSTGRES_PASSWORD", "OWNER_DATABASE_URL")
REQUIRED_REDIS_PASSWORD = re.compile(r"\$\{REDIS_PASSWORD:\?[^}]*\}")


def _role_problems(where: str, var: str, role: str | None, url: str, *, owner: bool) -> list[str]:
    """A database URL connects as the application role (``owner``: must not)."""
    user, _ = url_credentials(url)
    if owner and user == role:
        return [f"{where}: {var} connects as the application role {role}"]
    if not owner and user != role:
        return [f"{where}: {var} connects as {user}, not the application role {role}"]
    return []


def _redis_url_problems(where: str, values: dict[str, Any]) -> list[str]:
    problems = []
    redis_url = values.get("REDIS_URL")
    if redis_url is not None and not url_credentials(redis_url)[1]:
        problems.append(f"{where}: REDIS_URL carries no password")
    broker = values.get("BROKER_URL")
    if broker and not url_credentials(broker)[1]:
        problems.append(f"{where}: BROKER_URL carries no password")
    return problems


# --------------------------------------------------------------------------- compose


def compose_access_problems(doc: dict[str, Any]) -> list[str]:
    services: dict[str, Any] = doc["services"]
    problems = _compose_redis_problems(services["redis"])
    role = migrate_app_role(services["migrate"].get("command") or [])
    if role != APP_ROLE:
        problems.append(f"migrate: --app-role is {role!r}, not {APP_ROLE}")
    for name in COMPONENTS:
        env = env_map(services[name].get("environment"))
        held = set(env) & CREDENTIAL_VARS
        if held != COMPOSE_NEEDS[name]:
            problems.append(
                f"{name}: credential variables {sorted(held)}, "
                f"expected {sorted(COMPOSE_NEEDS[name])}"
            )
        if name != "migrate":
            problems.extend(
                f"{name}: {var} uses the schema owner's credentials"
                for var, value in env.items()
                if any(f"${{{owner}" in str(value) for owner in OWNER_VARS)
            )
        defaults = {var: compose_default(value) for var, value in env.items()}
        problems.extend(_redis_url_problems(name, defaults))
        if "DATABASE_URL" in defaults:
            problems.extend(
                _role_problems(
                    name, "DATABASE_URL", role, defaults["DATABASE_URL"], owner=name == "migrate"
                )
            )
    return problems


def _compose_redis_problems(redis: dict[str, Any]) -> list[str]:
    problems = []
    command = redis.get("command") or []
    text = " ".join(command) if isinstance(command, list) else str(command)
    password_from_env = re.search(r"--requirepass\s+\"?\$\$\{?REDIS_PASSWORD\b", text)
    if not password_from_env:
        problems.append("redis: not started with --requirepass $REDIS_PASSWORD")
    env = env_map(redis.get("environment"))
    if not REQUIRED_REDIS_PASSWORD.fullmatch(str(env.get("REDIS_PASSWORD", ""))):
        problems.append("redis: REDIS_PASSWORD is not a required variable (${REDIS_PASSWORD:?})")
    test = " ".join(map(str, (redis.get("healthcheck") or {}).get("test") or []))
    authenticated = "REDIS_PASSWORD" in str(env.get("REDISCLI_AUTH", "")) or " -a " in test
    if "redis-cli" not in test or not authenticated:
        problems.append("redis: health check does not authenticate (REDISCLI_AUTH)")
    return problems


# --------------------------------------------------------------------------- Kubernetes


def k8s_access_problems(docs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    migrate = find(docs, "Job", "teamdesk-migrate")
    role = migrate_app_role(argv(main_container(migrate))) if migrate else None
    if role != APP_ROLE:
        problems.append(f"migrate: --app-role is {role!r}, not {APP_ROLE}")
    for workload in of_kind(docs, "Deployment", "Job", "StatefulSet", "DaemonSet"):
        problems.extend(_workload_problems(workload))
    own = {f"teamdesk-{component}": component for component in COMPONENTS}
    for secret in of_kind(docs, "Secret"):
        name = secret["metadata"]["name"]
        if name not in own:
            problems.append(f"Secret {name} is no component's own")
            continue
        values = {**(secret.get("data") or {}), **(secret.get("stringData") or {})}
        component = own[name]
        if extra := sorted(set(values) - NEEDS[component]):
            problems.append(f"Secret {name} holds {extra}, which {component} does not read")
        problems.extend(_redis_url_problems(f"Secret {name}", values))
        for var in ("DATABASE_URL", "DISPATCH_LISTEN_URL"):
            if values.get(var) not in (None, "", "off"):
                problems.extend(
                    _role_problems(
                        f"Secret {name}", var, role, values[var], owner=name == "teamdesk-migrate"
                    )
                )
    return problems


def _workload_problems(workload: dict[str, Any]) -> list[str]:
    """The pod reads its component's own Secret, and from it only what it needs."""
    name = workload["metadata"]["name"]
    component = pod_labels(workload).get("app.kubernetes.io/component", "")
    own = f"teamdesk-{component}"
    problems = []
    for volume in pod_spec(workload).get("volumes") or []:
        if "secret" in volume or "projected" in volume:
            problems.append(f"{name}: mounts a Secret as a volume")
    for container in containers(workload):
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                problems.append(f"{name}: loads Secret {source['secretRef'].get('name')} whole")
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in container.get("env") or []
            if "secretKeyRef" in (e.get("valueFrom") or {})
        }
        if foreign := sorted({ref["name"] for ref in refs.values()} - {own}):
            problems.append(f"{name}: reads Secret(s) {foreign}, not only {own}")
        expected = NEEDS.get(component, frozenset())
        if set(refs) != expected:
            problems.append(
                f"{name}: credential variables {sorted(refs)}, expected {sorted(expected)}"
            )
    return problems


# --------------------------------------------------------------------------- tests


def test_compose_access(compose_doc: dict[str, Any]) -> None:
    assert compose_access_problems(compose_doc) == []


def test_k8s_access(k8s_docs: list[dict[str, Any]]) -> None:
    assert k8s_access_problems(k8s_docs) == []


def _set_env(service: str, var: str, value: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][service].setdefault("environment", {})[var] = value

    return mutate


def _drop_env(service: str, var: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        del doc["services"][service]["environment"][var]

    return mutate


def _set(service: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][service][key] = value

    return mutate


OWNER_URL = "${DATABASE_URL:-postgresql://teamdesk:${POSTGRES_PASSWORD}@postgres:5432/teamdesk}"
APP_URL = "${DATABASE_URL:-postgresql://teamdesk_app:${APP_DB_PASSWORD}@postgres:5432/teamdesk}"

COMPOSE_BREAKS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "redis without a password",
        _set("redis", "command", ["redis-server", "--appendonly", "yes"]),
        "redis: not started with --requirepass",
    ),
    (
        "redis password optional",
        _set_env("redis", "REDIS_PASSWORD", "${REDIS_PASSWORD:-}"),
        "redis: REDIS_PASSWORD is not a required variable",
    ),
    (
        "redis health check without auth",
        _drop_env("redis", "REDISCLI_AUTH"),
        "redis: health check does not authenticate",
    ),
    (
        "worker REDIS_URL without a password",
        _set_env("worker", "REDIS_URL", "${REDIS_URL:-redis://redis:6379/0}"),
        "worker: REDIS_URL carries no password",
    ),
    (
        "flower BROKER_URL without a password",
        _set_env("flower", "BROKER_URL", "${BROKER_URL:-redis://redis:6379/0}"),
        "flower: BROKER_URL carries no password",
    ),
    (
        "flower with a database URL",
        _set_env("flower", "DATABASE_URL", APP_URL),
        "flower: credential variables",
    ),
    (
        "worker with the app role's password",
        _set_env("worker", "APP_DB_PASSWORD", "${APP_DB_PASSWORD}"),
        "worker: credential variables",
    ),
    (
        "api as the owner",
        _set_env("api", "DATABASE_URL", OWNER_URL),
        "api: DATABASE_URL connects as teamdesk",
    ),
    (
        "beat with the owner's password elsewhere",
        _set_env("beat", "DISPATCH_LISTEN_URL", OWNER_URL),
        "beat: DISPATCH_LISTEN_URL uses the schema owner's credentials",
    ),
    (
        "migrate as the app role",
        _set_env("migrate", "DATABASE_URL", APP_URL),
        "migrate: DATABASE_URL connects as the application role",
    ),
    (
        "migrate sets up another role",
        _set("migrate", "command", ["teamdesk-tasks", "migrate", "--app-role", "other"]),
        "migrate: --app-role is 'other'",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in COMPOSE_BREAKS],
    ids=[name for name, _, _ in COMPOSE_BREAKS],
)
def test_compose_access_checks_catch_a_broken_file(
    compose_doc: dict[str, Any], mutate: Callable[[dict[str, Any]], None], expected: str
) -> None:
    broken = copy.deepcopy(compose_doc)
    mutate(broken)
    problems = compose_access_problems(broken)
    assert any(expected in p for p in problems), problems


def _container_of(
    kind: str, name: str, edit: Callable[[dict[str, Any]], None]
) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        doc = find(docs, kind, name)
        assert doc is not None
        edit(main_container(doc))

    return mutate


def _secret_value(name: str, key: str, value: str) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(docs: list[dict[str, Any]]) -> None:
        secret = find(docs, "Secret", name)
        assert secret is not None
        secret["stringData"][key] = value

    return mutate


def _env_ref(var: str, secret: str) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": var}}}


def _add_shared_secret(docs: list[dict[str, Any]]) -> None:
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "teamdesk-secrets"},
            "stringData": {"DATABASE_URL": "postgresql://teamdesk_app:x@db/teamdesk"},
        }
    )


K8S_OWNER = "postgresql://teamdesk:pw@postgres.example.internal:5432/teamdesk"
K8S_APP = "postgresql://teamdesk_app:pw@postgres.example.internal:5432/teamdesk"

K8S_BREAKS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    (
        "api loads the owner's Secret whole",
        _container_of(
            "Deployment",
            "teamdesk-api",
            lambda c: c["envFrom"].append({"secretRef": {"name": "teamdesk-migrate"}}),
        ),
        "teamdesk-api: loads Secret teamdesk-migrate whole",
    ),
    (
        "beat reads the owner's DATABASE_URL",
        _container_of(
            "Deployment",
            "teamdesk-beat",
            lambda c: c["env"].__setitem__(0, _env_ref("DATABASE_URL", "teamdesk-migrate")),
        ),
        "teamdesk-beat: reads Secret(s) ['teamdesk-migrate']",
    ),
    (
        "flower gets DATABASE_URL",
        _container_of(
            "Deployment",
            "teamdesk-flower",
            lambda c: c["env"].append(_env_ref("DATABASE_URL", "teamdesk-flower")),
        ),
        "teamdesk-flower: credential variables",
    ),
    (
        "worker reads another component's Secret",
        _container_of(
            "Deployment",
            "teamdesk-worker",
            lambda c: c["env"].append(_env_ref("APP_DB_PASSWORD", "teamdesk-api")),
        ),
        "teamdesk-worker: reads Secret(s) ['teamdesk-api']",
    ),
    (
        "flower's Secret holds a database URL",
        _secret_value("teamdesk-flower", "DATABASE_URL", K8S_APP),
        "Secret teamdesk-flower holds ['DATABASE_URL']",
    ),
    ("a shared Secret", _add_shared_secret, "Secret teamdesk-secrets is no component's own"),
    (
        "REDIS_URL without a password",
        _secret_value("teamdesk-api", "REDIS_URL", "redis://redis.example.internal:6379/0"),
        "Secret teamdesk-api: REDIS_URL carries no password",
    ),
    (
        "worker as the owner",
        _secret_value("teamdesk-worker", "DATABASE_URL", K8S_OWNER),
        "Secret teamdesk-worker: DATABASE_URL connects as teamdesk",
    ),
    (
        "beat listens as the owner",
        _secret_value("teamdesk-beat", "DISPATCH_LISTEN_URL", K8S_OWNER),
        "Secret teamdesk-beat: DISPATCH_LISTEN_URL connects as teamdesk",
    ),
    (
        "migrate as the app role",
        _secret_value("teamdesk-migrate", "DATABASE_URL", K8S_APP),
        "Secret teamdesk-migrate: DATABASE_URL connects as the application role",
    ),
    (
        "migrate without --app-role",
        _container_of(
            "Job",
            "teamdesk-migrate",
            lambda c: c.__setitem__("command", ["teamdesk-tasks", "migrate"]),
        ),
        "migrate: --app-role is None",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [(m, e) for _, m, e in K8S_BREAKS],
    ids=[name for name, _, _ in K8S_BREAKS],
)
def test_k8s_access_checks_catch_a_broken_manifest(
    k8s_docs: list[dict[str, Any]], mutate: Callable[[list[dict[str, Any]]], None], expected: str
) -> None:
    broken = copy.deepcopy(k8s_docs)
    mutate(broken)
    problems = k8s_access_problems(broken)
    assert any(expected in p for p in problems), problems
