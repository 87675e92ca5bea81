"""Who gets which credential, in deploy/compose.yaml and deploy/k8s/ (deploy/security.md,
"Who gets which secret"), checked offline on the parsed files.

- **One Redis user per component.** Compose starts Redis with ``--aclfile``: the users of
  deploy/redis/users.acl, each placeholder replaced by the SHA-256 of its password, read
  from a file (a Compose secret from ``redis/secrets/``, mounted into Redis alone): Redis's
  environment holds no password (``docker inspect`` shows none), and its health check
  authenticates as the administrator from that one's file; every ``REDIS_URL`` (Compose
  default, Kubernetes Secret) logs in as its component's own user
  (``teamdesk-<component>``) with a password, and so does every ``BROKER_URL`` that is
  not empty (empty = ``REDIS_URL``).
- **Three database roles.** Migrate alone holds the schema owner's ``DATABASE_URL`` and
  the roles' passwords and sets up the application role (``--app-role teamdesk_app``)
  and the API's (``--api-role teamdesk_api``); the API's ``DATABASE_URL`` connects as
  the API's role, the workers' and beat's (and a ``DISPATCH_LISTEN_URL``) as the
  application role.
- **Each component gets only what it reads** (``NEEDS``): Flower no database URL at all;
  in Compose no service interpolates another's password. On Kubernetes each pod reads
  its own Secret only, variable by variable (a Secret is never loaded whole with
  ``envFrom``), and each Secret holds only its component's variables; the old shared
  ``teamdesk-secrets`` is gone.

Every check is shown to fail on a copy broken in exactly that point.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from teamdesk.redis_acl import ADMIN, PASSWORD_VARS
from teamdesk.redis_acl import COMPONENTS as REDIS_COMPONENTS
from tests.support.deploy_files import (
    API_ROLE,
    APP_ROLE,
    COMPONENTS,
    CREDENTIAL_VARS,
    DATABASE_ROLE,
    NEEDS,
    OWN_SECRETS,
    REDIS_USER,
    SECRET_VARS,
    argv,
    compose_default,
    containers,
    env_map,
    find,
    main_container,
    migrate_api_role,
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
ROLE_NAMES = {APP_ROLE: "the application role", API_ROLE: "the API's role"}


def _role_problems(where: str, var: str, component: str, url: str) -> list[str]:
    """A database URL connects as the component's role (migrate: as neither role)."""
    user, _ = url_credentials(url)
    if component == "migrate":
        if user in ROLE_NAMES:
            return [f"{where}: {var} connects as {ROLE_NAMES[user]} {user}"]
        return []
    role = DATABASE_ROLE.get(component)
    if role is None:  # Flower: NEEDS says it holds no database URL at all
        return []
    if user != role:
        return [f"{where}: {var} connects as {user}, not {ROLE_NAMES[role]} {role}"]
    return []


def _redis_url_problems(where: str, component: str, values: dict[str, Any]) -> list[str]:
    """REDIS_URL (and a BROKER_URL on Redis) log in as the component's own user."""
    problems = []
    for var in ("REDIS_URL", "BROKER_URL"):
        url = values.get(var)
        if not url or (var == "BROKER_URL" and not str(url).startswith(("redis", "sentinel"))):
            continue
        user, password = url_credentials(url)
        if not password:
            problems.append(f"{where}: {var} carries no password")
        if user != REDIS_USER[component]:
            problems.append(f"{where}: {var} logs in as {user!r}, not {REDIS_USER[component]}")
    return problems


def _migrate_problems(command: list[str]) -> list[str]:
    problems = []
    if (role := migrate_app_role(command)) != APP_ROLE:
        problems.append(f"migrate: --app-role is {role!r}, not {APP_ROLE}")
    if (role := migrate_api_role(command)) != API_ROLE:
        problems.append(f"migrate: --api-role is {role!r}, not {API_ROLE}")
    return problems


def _foreign_secrets(name: str, env: dict[str, Any]) -> list[str]:
    """Compose: the secrets ``name``'s environment interpolates that are not its own."""
    used = {
        var
        for value in env.values()
        for var in re.findall(r"\$\{([A-Z0-9_]+)", str(value))
        if var in SECRET_VARS
    }
    return [f"{name}: interpolates {var}, not its own" for var in sorted(used - OWN_SECRETS[name])]


# --------------------------------------------------------------------------- compose


def compose_access_problems(doc: dict[str, Any]) -> list[str]:
    services: dict[str, Any] = doc["services"]
    problems = _compose_redis_problems(services["redis"], doc.get("secrets") or {})
    problems.extend(_redis_secrets_elsewhere(services))
    problems.extend(_migrate_problems(services["migrate"].get("command") or []))
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
        problems.extend(_foreign_secrets(name, env))
        defaults = {var: compose_default(value) for var, value in env.items()}
        problems.extend(_redis_url_problems(name, name, defaults))
        if "DATABASE_URL" in defaults:
            problems.extend(_role_problems(name, "DATABASE_URL", name, defaults["DATABASE_URL"]))
    return problems


USERS_FILE = re.compile(r"\./redis/users\.acl:(\S+?)(:ro)?")
# The Redis passwords: one Compose secret each, named like its variable.
REDIS_SECRETS = {
    PASSWORD_VARS[role]: PASSWORD_VARS[role].lower() for role in (ADMIN, *REDIS_COMPONENTS)
}
ADMIN_FILE = f"/run/secrets/{REDIS_SECRETS[PASSWORD_VARS[ADMIN]]}"


def _compose_redis_problems(redis: dict[str, Any], secrets: dict[str, Any]) -> list[str]:
    """Redis loads deploy/redis/users.acl with every password placeholder replaced from
    its secret file; no password in its environment; the health check logs in as the
    administrator from that one's file."""
    problems = []
    command = redis.get("command") or []
    text = " ".join(command) if isinstance(command, list) else str(command)
    mounts = [m for v in redis.get("volumes") or [] if (m := USERS_FILE.fullmatch(str(v)))]
    if not mounts:
        problems.append("redis: ./redis/users.acl is not mounted")
    elif mounts[0].group(1) not in text or "--aclfile" not in text:
        problems.append("redis: not started with --aclfile from ./redis/users.acl")
    for role in (ADMIN, *REDIS_COMPONENTS):
        problems.extend(_password_file_problems(role, redis, secrets, text))
    problems.extend(_environment_passwords(redis))
    test = " ".join(map(str, (redis.get("healthcheck") or {}).get("test") or []))
    if "redis-cli" not in test or ADMIN_FILE not in test or "PONG" not in test:
        problems.append(f"redis: health check does not authenticate from {ADMIN_FILE}")
    return problems


def _password_file_problems(
    role: str, redis: dict[str, Any], secrets: dict[str, Any], script: str
) -> list[str]:
    var = PASSWORD_VARS[role]
    name = REDIS_SECRETS[var]
    problems = []
    if name not in (redis.get("secrets") or []):
        problems.append(f"redis: does not mount secret {name}")
    if (secrets.get(name) or {}).get("file") != f"./redis/secrets/{name}":
        # Compose copies any other kind into the container: refused on a read-only one.
        problems.append(f"redis: secret {name} is not the file ./redis/secrets/{name}")
    hashed = f"{name}_sha=$$(hash_of {name})"  # the script's lines, Compose's $$ kept
    replaced = f"/#sha256({var})/#$${name}_sha/"
    if hashed not in script or replaced not in script:
        problems.append(f"redis: the {role} user's placeholder is not replaced from {name}")
    return problems


def _environment_passwords(redis: dict[str, Any]) -> list[str]:
    """Redis's environment (``docker inspect``) holds no password, nor names one."""
    env = env_map(redis.get("environment"))
    return [
        f"redis: its environment holds {var}"
        for var, value in env.items()
        if var in SECRET_VARS
        or var == "REDISCLI_AUTH"
        or any(f"${{{secret}" in str(value) for secret in SECRET_VARS)
    ]


def _redis_secrets_elsewhere(services: dict[str, Any]) -> list[str]:
    """The Redis passwords' files are mounted into Redis alone."""
    problems = []
    for name, svc in services.items():
        if name == "redis":
            continue
        for entry in svc.get("secrets") or []:
            secret = entry.get("source") if isinstance(entry, dict) else entry
            if secret in REDIS_SECRETS.values():
                problems.append(f"{name}: mounts Redis's secret {secret}")
    return problems


# --------------------------------------------------------------------------- Kubernetes


def k8s_access_problems(docs: list[dict[str, Any]]) -> list[str]:
    migrate = find(docs, "Job", "teamdesk-migrate")
    problems = _migrate_problems(argv(main_container(migrate)) if migrate else [])
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
        if component != "migrate":
            problems.extend(_redis_url_problems(f"Secret {name}", component, values))
        for var in ("DATABASE_URL", "DISPATCH_LISTEN_URL"):
            if values.get(var) not in (None, "", "off"):
                problems.extend(_role_problems(f"Secret {name}", var, component, values[var]))
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


def _set(service: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"][service][key] = value

    return mutate


OWNER_URL = "${DATABASE_URL:-postgresql://teamdesk:${POSTGRES_PASSWORD}@postgres:5432/teamdesk}"
APP_URL = "${DATABASE_URL:-postgresql://teamdesk_app:${APP_DB_PASSWORD}@postgres:5432/teamdesk}"
API_URL = "${API_DATABASE_URL:-postgresql://teamdesk_api:${API_DB_PASSWORD}@postgres:5432/teamdesk}"
API_REDIS = "${API_REDIS_URL:-redis://teamdesk-api:${REDIS_API_PASSWORD}@redis:6379/0}"


def _redis_script(edit: Callable[[str], str]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        command = doc["services"]["redis"]["command"]
        command[-1] = edit(command[-1])

    return mutate


def _set_secret(name: str, value: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["secrets"][name] = value

    return mutate


def _unmount_secret(name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["services"]["redis"]["secrets"].remove(name)

    return mutate


def _unmount_users(doc: dict[str, Any]) -> None:
    redis = doc["services"]["redis"]
    redis["volumes"] = [v for v in redis["volumes"] if "users.acl" not in v]


COMPOSE_BREAKS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "redis without its users",
        _set("redis", "command", ["redis-server", "--appendonly", "yes"]),
        "redis: not started with --aclfile from ./redis/users.acl",
    ),
    ("redis without the users file", _unmount_users, "redis: ./redis/users.acl is not mounted"),
    (
        "a user's placeholder left in",
        _redis_script(lambda s: s.replace("REDIS_API_PASSWORD)/", "REDIS_APIPASSWORD)/")),
        "redis: the api user's placeholder is not replaced from redis_api_password",
    ),
    (
        "a user's password back in Redis's environment",
        _set_env("redis", "REDIS_BEAT_PASSWORD", "${REDIS_BEAT_PASSWORD:?set it}"),
        "redis: its environment holds REDIS_BEAT_PASSWORD",
    ),
    (
        "the administrator's password for redis-cli in the environment",
        _set_env("redis", "REDISCLI_AUTH", "${REDIS_PASSWORD}"),
        "redis: its environment holds REDISCLI_AUTH",
    ),
    (
        "a password hidden in another variable",
        _set_env("redis", "EXTRA", "x${REDIS_WORKER_PASSWORD}"),
        "redis: its environment holds EXTRA",
    ),
    (
        "redis health check without auth",
        _set("redis", "healthcheck", {"test": ["CMD", "redis-cli", "ping"]}),
        "redis: health check does not authenticate",
    ),
    (
        "a password secret from the environment",
        _set_secret("redis_api_password", {"environment": "REDIS_API_PASSWORD"}),
        "redis: secret redis_api_password is not the file",
    ),
    (
        "a password secret not mounted",
        _unmount_secret("redis_flower_password"),
        "redis: does not mount secret redis_flower_password",
    ),
    (
        "the API mounts the administrator's password",
        _set("api", "secrets", ["redis_password"]),
        "api: mounts Redis's secret redis_password",
    ),
    (
        "worker logs in as the API's Redis user",
        _set_env("worker", "REDIS_URL", API_REDIS),
        "worker: REDIS_URL logs in as 'teamdesk-api', not teamdesk-worker",
    ),
    (
        "beat holds the API's Redis password",
        _set_env("beat", "REDIS_URL", API_REDIS),
        "beat: interpolates REDIS_API_PASSWORD, not its own",
    ),
    (
        "the API as the application role",
        _set_env("api", "DATABASE_URL", APP_URL),
        "api: DATABASE_URL connects as teamdesk_app, not the API's role teamdesk_api",
    ),
    (
        "the API holds the application role's password",
        _set_env("api", "EXTRA", "${APP_DB_PASSWORD}"),
        "api: interpolates APP_DB_PASSWORD, not its own",
    ),
    (
        "the worker as the API's role",
        _set_env("worker", "DATABASE_URL", API_URL),
        "worker: DATABASE_URL connects as teamdesk_api, not the application role",
    ),
    (
        "migrate without --api-role",
        _set("migrate", "command", ["teamdesk-tasks", "migrate", "--app-role", "teamdesk_app"]),
        "migrate: --api-role is None, not teamdesk_api",
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
K8S_API = "postgresql://teamdesk_api:pw@postgres.example.internal:5432/teamdesk"

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
        "the API as the application role",
        _secret_value("teamdesk-api", "DATABASE_URL", K8S_APP),
        "Secret teamdesk-api: DATABASE_URL connects as teamdesk_app, not the API's role",
    ),
    (
        "beat as the API's role",
        _secret_value("teamdesk-beat", "DATABASE_URL", K8S_API),
        "Secret teamdesk-beat: DATABASE_URL connects as teamdesk_api, not the application role",
    ),
    (
        "migrate as the API's role",
        _secret_value("teamdesk-migrate", "DATABASE_URL", K8S_API),
        "Secret teamdesk-migrate: DATABASE_URL connects as the API's role teamdesk_api",
    ),
    (
        "beat logs in as the worker's Redis user",
        _secret_value("teamdesk-beat", "REDIS_URL", "redis://teamdesk-worker:pw@redis:6379/0"),
        "Secret teamdesk-beat: REDIS_URL logs in as 'teamdesk-worker', not teamdesk-beat",
    ),
    (
        "Flower's broker as the administrator",
        _secret_value("teamdesk-flower", "BROKER_URL", "redis://:pw@redis:6379/0"),
        "Secret teamdesk-flower: BROKER_URL logs in as '', not teamdesk-flower",
    ),
    (
        "migrate without --api-role",
        _container_of(
            "Job",
            "teamdesk-migrate",
            lambda c: c.__setitem__(
                "command", ["teamdesk-tasks", "migrate", "--app-role", "teamdesk_app"]
            ),
        ),
        "migrate: --api-role is None",
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
