"""P7: export creations per second through the HTTP API (``POST /api/teams/{team}/exports``),
8 concurrent clients, no worker running.

The API runs as in production: ``teamdesk-tasks api`` processes, one uvicorn process each,
``API_PROCESSES`` of them (deploy/k8s/api.yaml runs two replicas), every client sending
to one of them in turn as a Service would spread connections. Each client keeps one HTTP
connection open (keep-alive) and has its own token and team, so the per-team cap
(``TEAM_MAX_UNFINISHED``, default 1,000) is never reached; the per-token rate limit stays
on, with a budget no client reaches, so its Redis round trip is part of every request.
Creations are counted for ``MEASURE_S`` after a ``WARMUP_S`` warm-up; the figure with one
process is in the detail. The clients share the machine's two cores with the API. What a
creation costs is in the detail too: CPU microseconds per creation of the API processes,
the database's backends, Redis, this process (the clients) and the rest of the machine,
from /proc over the counting window.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from bench.env import (
    BenchEnv,
    Part,
    backend_pids,
    children,
    cpu_seconds,
    machine_busy_s,
    redis_cpu,
    stop,
    wait_until,
)
from harness.processes import Proc, free_port, settings_env
from ledger.tokens import create_token

CLIENTS = 8
API_PROCESSES = 2  # deploy/k8s/api.yaml: replicas: 2 (one uvicorn process each)
WARMUP_S = 1.0
MEASURE_S = 5.0
UNLIMITED = 1_000_000_000  # a per-token rate no client reaches (the limiter still runs)
# CSV bytes a team's exports of the day may hold: each unfinished export holds its
# reservation (EXPORT_MAX_BYTES, 32 MiB), so a billion bytes refused the 30th creation of
# a client's team and every one after it (429); a petabyte holds millions of them.
UNLIMITED_BYTES = 1 << 50


@dataclass
class Tally:
    ok: int = 0
    errors: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class CpuAt:
    """CPU seconds used so far by each side of P7."""

    api: float
    postgres: dict[int, float]
    redis: float
    clients: float
    machine: float


def cpu_at(env: BenchEnv, part: Part, apis: list[Proc]) -> CpuAt:
    return CpuAt(
        api=sum(cpu_seconds(pid) for p in apis for pid in (p.pid, *children(p.pid))),
        postgres={pid: cpu_seconds(pid) for pid in backend_pids(part.engine, part.db_name)},
        redis=redis_cpu(env.redis),
        clients=time.process_time(),  # this process: the client threads, and little else
        machine=machine_busy_s(),
    )


def cpu_split_us(before: CpuAt, after: CpuAt, creations: int) -> dict[str, int]:
    """CPU microseconds per creation of each side between two snapshots."""
    postgres = sum(s - before.postgres.get(pid, 0.0) for pid, s in after.postgres.items())
    sides = {
        "api": after.api - before.api,
        "postgres": postgres,
        "redis": after.redis - before.redis,
        "clients": after.clients - before.clients,
    }
    sides["rest_of_machine"] = max(0.0, after.machine - before.machine - sum(sides.values()))
    return {k: round(v / max(creations, 1) * 1e6) for k, v in sides.items()}


def seed_clients(engine: sa.Engine, n: int) -> list[tuple[str, str]]:
    """``n`` teams, a staff member each with a token: (team id, token) per client."""
    clients = []
    with engine.begin() as conn:
        for i in range(n):
            team = conn.execute(
                sa.text("INSERT INTO teams (name) VALUES (:n) RETURNING id"), {"n": f"p7-{i}"}
            ).scalar_one()
            user = conn.execute(
                sa.text("INSERT INTO users (email, name) VALUES (:e, 'p7') RETURNING id"),
                {"e": f"p7-{i}@bench.test"},
            ).scalar_one()
            conn.execute(
                sa.text(
                    "INSERT INTO memberships (team_id, user_id, role) VALUES (:t, :u, 'STAFF')"
                ),
                {"t": team, "u": user},
            )
            clients.append((str(team), create_token(conn, user, "bench p7")))
    return clients


def start_api(env: BenchEnv, part: Part, index: int) -> tuple[Proc, int]:
    port = free_port()
    argv = [sys.executable, "-m", "cli.main", "api", "--host", "127.0.0.1", "--port", str(port)]
    # Limits and quotas no client reaches: every check still runs (the rate limiter's
    # Redis call, the daily export quota's count of the team's exports today) and never
    # refuses (each client's team creates thousands of exports in seconds).
    extra = {
        "API_RATE_PER_MIN": UNLIMITED,
        "API_RATE_BURST": UNLIMITED,
        "TEAM_EXPORTS_PER_DAY": UNLIMITED,
        "TEAM_EXPORT_BYTES_PER_DAY": UNLIMITED_BYTES,
        "LOG_LEVEL": "warn",
    }
    proc = Proc(f"p7-api-{index}", argv, settings_env(part.settings, **extra), env.workdir)
    proc.start()
    part.procs.append(proc)
    wait_until(lambda: _healthy(port), timeout=60, what=f"API {index} to answer")
    return proc, port


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/api/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


def client(port: int, team: str, token: str, until: list[float], tally: Tally) -> None:
    body = json.dumps({"scope": "TEAM", "filters": {}})
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    counting_from, stop_at = until
    while (now := time.monotonic()) < stop_at:
        conn.request("POST", f"/api/teams/{team}/exports", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        if now < counting_from:
            continue
        with tally.lock:
            if response.status == 201:
                tally.ok += 1
            else:
                tally.errors[response.status] = tally.errors.get(response.status, 0) + 1
    conn.close()


def measure(
    env: BenchEnv, part: Part, apis: list[tuple[Proc, int]], clients: list[tuple[str, str]]
) -> dict[str, Any]:
    tally = Tally()
    ports = [port for _, port in apis]
    start = time.monotonic()
    window = [start + WARMUP_S, start + WARMUP_S + MEASURE_S]
    threads = [
        threading.Thread(target=client, args=(ports[i % len(ports)], team, token, window, tally))
        for i, (team, token) in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, window[0] - time.monotonic()))
    before = cpu_at(env, part, [proc for proc, _ in apis])
    time.sleep(max(0.0, window[1] - time.monotonic()))
    after = cpu_at(env, part, [proc for proc, _ in apis])
    for thread in threads:
        thread.join()
    if tally.errors:  # a figure of refusals would measure the refusal, not the creation
        raise RuntimeError(f"P7: creations refused while counting: {tally.errors}")
    return {
        "processes": len(ports),
        "creates_per_s": round(tally.ok / MEASURE_S, 1),
        "errors": {str(k): v for k, v in tally.errors.items()},
        "cpu_us_per_create": cpu_split_us(before, after, tally.ok),
    }


def run_p7(env: BenchEnv) -> dict[str, Any]:
    results = []
    for processes in (1, API_PROCESSES):
        part = env.part(f"p7-{processes}")
        clients = seed_clients(part.engine, CLIENTS)
        apis = [start_api(env, part, i) for i in range(processes)]
        results.append(measure(env, part, apis, clients))
        for proc, _ in apis:
            stop(proc)
    production = results[-1]
    return {
        "p7_api_creates_per_s": production["creates_per_s"],
        "p7_api_processes": API_PROCESSES,
        "p7_detail": {"clients": CLIENTS, "measure_s": MEASURE_S, "runs": results},
    }
