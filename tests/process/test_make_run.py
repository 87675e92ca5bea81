"""``make run`` smoke test: the local cluster comes up, the printed ``curl`` starts an export
that completes (seen through the API and Flower), and one SIGTERM to the runner brings
every process down with exit 0.

The runner is started the way ``make run`` starts it (``teamdesk-tasks run-local``), but on
this test's database, a throwaway QUEUE_PREFIX and free ports, never the default
``teamdesk`` database or ports 8000/5555."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from harness.factories import task_row
from harness.processes import ROOT, Proc, free_port, settings_env
from harness.remote_gates import RemoteGate
from harness.waiting import wait_for
from teamdesk.config import Settings

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).parent / "teamdesk-tasks")
PROCESSES = ("exports", "mixed", "beat", "flower", "api")
TICKETS = 1200
FLOWER_PASSWORD = "smoke-test-pw"
GATED = {
    "TEAMDESK_TEST_HOOKS": "harness.remote_gates",
    "TEAMDESK_TEST_GATES": "export.after_read",
    "TEAMDESK_TEST_GATE_TIMEOUT_S": "120",
    "PYTHONPATH": str(ROOT),  # the Procfile runs the `celery` script: put tests/ in reach
}
LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<name>\S+)\s*\| (?P<text>.*)$")


def prefixed(runner: Proc, name: str) -> list[str]:
    """The lines the runner printed for process ``name`` (its prefix removed)."""
    found = []
    for line in runner.output().splitlines():
        match = LINE.match(line)
        if match and match.group("name") == name:
            found.append(match.group("text"))
    return found


def events(runner: Proc, name: str, event: str) -> list[dict[str, Any]]:
    found = []
    for text in prefixed(runner, name):
        with suppress(ValueError):
            record = json.loads(text)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found


def http(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)
    except OSError:
        return 0, b"", {}


def curl_request(command: str) -> dict[str, Any]:
    """The printed ``curl -s -X POST -H ... -d ... URL`` as (method, headers, body, url)."""
    words = shlex.split(command)
    assert words[:2] == ["curl", "-s"], command
    request: dict[str, Any] = {"method": "GET", "headers": {}, "body": None, "url": None}
    items = iter(words[2:])
    for word in items:
        if word == "-X":
            request["method"] = next(items)
        elif word == "-H":
            key, _, value = next(items).partition(": ")
            request["headers"][key] = value
        elif word == "-d":
            request["body"] = next(items).encode()
        else:
            request["url"] = word
    return request


def printed_commands(runner: Proc) -> tuple[str, str]:
    """The export curl and the read-back curl from the banner."""
    lines = [line.strip() for line in runner.output().splitlines()]
    start = next(line for line in lines if line.startswith("curl -s -X POST"))
    read = next(line for line in lines if line.startswith("curl -s -H") and "<TASK_ID>" in line)
    return start, read


def printed_reminder(runner: Proc) -> str:
    """The banner's reminder curl (the second POST)."""
    lines = [line.strip() for line in runner.output().splitlines()]
    return next(line for line in lines if line.startswith("curl") and "/reminders" in line)


def stop_everything(runner: Proc) -> None:
    """Teardown after a failure: the runner's children live in their own sessions, so
    killing the runner alone would leave them running."""
    pids = [int(p) for p in re.findall(r"started \(pid=(\d+)\)", runner.output())]
    if runner.popen is not None and runner.popen.poll() is None:
        with suppress(ProcessLookupError):
            runner.send(signal.SIGTERM)
        with suppress(Exception):
            runner.wait(timeout=30)
    runner.kill()
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


class Runner:
    """Starts ``teamdesk-tasks run-local`` runs for one test and stops them all at its end."""

    def __init__(self, settings: Settings, tmp_path: Path) -> None:
        self.settings, self.tmp_path = settings, tmp_path
        self.started: list[Proc] = []
        self.environ: dict[str, str] = {}

    def start(
        self, *args: str, tickets: int = TICKETS, env: dict[str, str] | None = None
    ) -> tuple[Proc, int, int]:
        api_port, flower_port = free_port(), free_port()
        argv = [
            CLI,
            "run-local",
            "--api-port",
            str(api_port),
            "--flower-port",
            str(flower_port),
            "--tickets",
            str(tickets),
            *args,
        ]
        environ = settings_env(
            self.settings.with_overrides(scan_interval_s=1.0),
            FLOWER_PASSWORD=FLOWER_PASSWORD,
            **(env or {}),
        )
        name = f"run-local-{len(self.started)}"
        self.environ = environ
        runner = Proc(name, argv, environ, self.tmp_path).start()
        self.started.append(runner)
        return runner, api_port, flower_port


@pytest.fixture
def runners(settings: Settings, tmp_path: Path) -> Iterator[Runner]:
    made = Runner(settings, tmp_path)
    try:
        yield made
    finally:
        for runner in made.started:
            stop_everything(runner)


def alive(runner: Proc) -> bool:
    if runner.popen is not None and runner.popen.poll() is not None:
        raise AssertionError(f"run-local exited early:\n{runner.output()[-4000:]}")
    return True


def wait_until_up(runner: Proc, api_port: int, flower_port: int) -> None:
    """The API answers, both workers logged worker.started, Flower answers."""
    api = f"http://127.0.0.1:{api_port}"
    wait_for(
        lambda: alive(runner) and http(f"{api}/api/health")[0] == 200,
        timeout=60,
        interval=0.2,
        what="the API's /api/health",
    )
    for worker in ("exports", "mixed"):
        wait_for(
            lambda w=worker: alive(runner) and events(runner, w, "worker.started"),  # type: ignore[misc]
            timeout=60,
            interval=0.2,
            what=f"{worker} worker.started",
        )
    flower = f"http://127.0.0.1:{flower_port}"
    wait_for(lambda: http(f"{flower}/healthcheck")[0] == 200, timeout=30, what="Flower")


def submit_printed_export(runner: Proc, api_port: int) -> tuple[str, dict[str, Any]]:
    """Sends the banner's curl; returns the task id and the read-back request."""
    start, read = printed_commands(runner)
    request = curl_request(start)
    assert request["url"].startswith(f"http://127.0.0.1:{api_port}/api/teams/")
    assert request["method"] == "POST"
    assert json.loads(request["body"]) == {"scope": "TEAM", "filters": {}}
    status, body, _ = http(
        request["url"], method="POST", headers=request["headers"], body=request["body"]
    )
    assert status == 201, body
    task_id = str(json.loads(body)["id"])
    return task_id, curl_request(read.replace("<TASK_ID>", task_id))


def assert_stopped_cleanly(runner: Proc) -> None:
    """Exit 0; each process got exactly one SIGTERM and exited 0; workers drained once."""
    assert runner.wait(timeout=60) == 0, runner.output()[-4000:]
    system = prefixed(runner, "system")
    for name in PROCESSES:
        assert sum(line.startswith(f"sent SIGTERM to {name} ") for line in system) == 1, name
        assert f"{name} stopped (rc=0)" in system, name
    assert system[-1] == "all processes stopped cleanly"
    assert not [line for line in system if "SIGKILL" in line]
    for worker in ("exports", "mixed"):
        stopping = events(runner, worker, "worker.stopping")
        assert [e.get("signal") for e in stopping] == ["SIGTERM"], worker
        assert [e["exit_code"] for e in events(runner, worker, "worker.stopped")] == [0]


def probe(runners: Runner, *args: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [CLI, "health", *args], env=runners.environ, capture_output=True, text=True, timeout=30
    )
    return done.returncode, done.stdout, done.stderr


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports (METRICS_PORT's base under run-local)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        with ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {count} consecutive free ports")


def scrape(port: int) -> str:
    code, body, _ = http(f"http://127.0.0.1:{port}/metrics")
    assert code == 200
    return body.decode()


def test_make_run_serves_an_export_end_to_end_and_stops_cleanly(runners: Runner) -> None:
    metrics_base = free_port_run(4)
    runner, api_port, flower_port = runners.start(env={"METRICS_PORT": str(metrics_base)})
    wait_until_up(runner, api_port, flower_port)
    # METRICS_PORT is a base: each process that serves metrics has its own port (the
    # banner says which), and a worker serves its task families before its first task.
    # Before, every process took the same port and all but one died.
    names = ("exports", "mixed", "beat", "api")
    ports = {name: metrics_base + offset for offset, name in enumerate(names)}
    each = ", ".join(f"{name} :{port}" for name, port in ports.items())
    assert f"  Metrics  http://127.0.0.1:<port>/metrics   {each}" in runner.output()
    for worker in ("exports", "mixed"):
        assert 'teamdesk_task_claims_total{kind="export"} 0.0' in scrape(ports[worker])
    assert "teamdesk_dispatcher_leader" in scrape(ports["beat"])
    assert "teamdesk_api_requests_total" in scrape(ports["api"])
    # The probes the banner prints answer "able" for this very cluster.
    printed = [line.strip() for line in runner.output().splitlines()]
    assert any(line.startswith(".venv/bin/teamdesk-tasks health --cluster") for line in printed)
    assert any("`health --scope local-exports`" in line for line in printed)
    wait_for(
        lambda: alive(runner) and probe(runners, "--cluster")[0] == 0,
        timeout=30,
        interval=0.5,
        what="health --cluster to say the cluster is able",
    )
    code, out, err = probe(runners, "--cluster")
    report = json.loads(out)
    assert (code, err, report["problems"], report["missing"]) == (0, "", [], [])
    assert (report["redis"], report["database"]) == (True, True)
    assert probe(runners, "--scope", "local-exports")[0] == 0
    task_id, readback = submit_printed_export(runner, api_port)

    def task() -> dict[str, Any]:
        code, answer, _ = http(readback["url"], headers=readback["headers"])
        assert code == 200, answer
        result: dict[str, Any] = json.loads(answer)
        return result

    def ended() -> dict[str, Any] | None:
        view = task() if alive(runner) else None
        return view if view and view["status"] in ("COMPLETED", "FAILED") else None

    done = wait_for(ended, timeout=60, interval=0.2, what="the export to end")
    assert done is not None
    assert (done["status"], done["progress"], done["result_summary"]) == (
        "COMPLETED",
        100,
        f"{TICKETS} rows",
    )
    # The banner's reminder is for an open ticket assigned to the staff user: it is sent,
    # not skipped (before, the banner offered no ticket, and the first one a user found
    # was often closed).
    reminder = curl_request(printed_reminder(runner))
    status, body, _ = http(
        reminder["url"], method="POST", headers=reminder["headers"], body=reminder["body"]
    )
    assert status == 201, body
    reminder_url = readback["url"].rsplit("/", 1)[0] + "/" + json.loads(body)["id"]

    def reminded() -> dict[str, Any] | None:
        code, answer, _ = http(reminder_url, headers=readback["headers"])
        view: dict[str, Any] = json.loads(answer) if code == 200 else {}
        return view if view.get("status") == "COMPLETED" else None

    sent = wait_for(reminded, timeout=60, interval=0.2, what="the reminder to complete")
    assert sent is not None and sent["skipped"] is False
    assert str(sent["result_summary"]).startswith("reminder sent to ")
    code, csv_body, headers = http(f"{readback['url']}/csv", headers=readback["headers"])
    assert code == 200 and headers["content-type"].startswith("text/csv")
    assert len(list(csv.reader(io.StringIO(csv_body.decode())))) == TICKETS + 1
    # The real server (uvicorn) says nothing about itself; the security headers are there.
    _, _, read_headers = http(readback["url"], headers=readback["headers"])
    for answer in (headers, read_headers):
        lowered = {name.lower(): value for name, value in answer.items()}
        assert "server" not in lowered
        assert lowered["x-content-type-options"] == "nosniff"
        assert lowered["cache-control"] == "no-store"

    # Flower saw it too (behind basic auth).
    auth = base64.b64encode(f"admin:{FLOWER_PASSWORD}".encode()).decode()
    info_url = f"http://127.0.0.1:{flower_port}/api/task/info/{task_id}-0"
    assert http(info_url)[0] == 401
    wait_for(
        lambda: (
            json.loads(http(info_url, headers={"Authorization": f"Basic {auth}"})[1] or b"{}").get(
                "state"
            )
            == "SUCCESS"
        ),
        timeout=20,
        what="Flower to show the export's SUCCESS",
    )

    runner.send(signal.SIGTERM)
    assert_stopped_cleanly(runner)


def test_sigterm_lets_an_export_in_flight_finish_before_everything_exits_0(
    runners: Runner, engine: sa.Engine, redis_client: redis.Redis, settings: Settings
) -> None:
    gate = RemoteGate(redis_client, settings.queue_prefix, "export.after_read")
    runner, api_port, flower_port = runners.start(env=GATED)
    wait_until_up(runner, api_port, flower_port)
    task_id, _ = submit_printed_export(runner, api_port)
    parked = gate.wait_reached()
    assert parked["task_id"] == task_id

    runner.send(signal.SIGTERM)
    for name in ("api", "flower", "beat"):
        wait_for(
            lambda n=name: f"{n} stopped (rc=0)" in prefixed(runner, "system"),  # type: ignore[misc]
            timeout=30,
            what=f"{name} to stop",
        )
    row = task_row(engine, uuid.UUID(task_id))
    assert row["status"] == "RUNNING"
    assert str(row["execution_id"]) == parked["execution_id"]
    # It says what it waits for (before: nothing while the export drained).
    # The worker that holds it (either consumes exports) is the one named.
    note = re.compile(r"waiting for (exports|mixed) to stop \(workers finish their running tasks")
    wait_for(lambda: note.search(runner.output()), timeout=30, what="the waiting note")

    gate.release(times=3)
    assert_stopped_cleanly(runner)
    done = task_row(engine, uuid.UUID(task_id))
    assert (done["status"], done["attempts"], done["result_summary"]) == (
        "COMPLETED",
        1,
        f"{TICKETS} rows",
    )


CHILD = """
import signal, sys, time
mode = sys.argv[1]
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    if mode == "clean":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
if mode == "quits":
    time.sleep(0.5)
    sys.exit(3)
while True:
    time.sleep(0.05)
"""


def child_procfile(tmp_path: Path, **modes: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    procfile = tmp_path / "Procfile"
    procfile.write_text(
        "# test processes\n"
        + "".join(f"{name}: python -u {script} {mode}\n" for name, mode in modes.items())
    )
    return procfile


def wait_system_line(runner: Proc, text: str) -> None:
    wait_for(lambda: text in prefixed(runner, "system"), timeout=30, what=text)


def test_a_process_that_exits_on_its_own_stops_the_others_and_fails_the_run(
    runners: Runner, tmp_path: Path
) -> None:
    procfile = child_procfile(tmp_path, calm="clean", quitter="quits")
    runner, _, _ = runners.start("--procfile", str(procfile), tickets=0)
    assert runner.wait(timeout=60) == 1, runner.output()[-3000:]
    system = prefixed(runner, "system")
    assert "quitter stopped (rc=3)" in system
    assert "quitter exited on its own: stopping the others" in system
    assert "calm stopped (rc=0)" in system
    assert prefixed(runner, "calm") == ["up", "got SIGTERM"]
    assert system[-1] == "stopped with failures (non-zero: quitter rc=3)"


def test_a_second_signal_kills_what_is_left(runners: Runner, tmp_path: Path) -> None:
    procfile = child_procfile(tmp_path, calm="clean", stubborn="stubborn")
    runner, _, _ = runners.start("--procfile", str(procfile), tickets=0)
    wait_for(lambda: prefixed(runner, "stubborn") == ["up"], timeout=30, what="stubborn up")
    wait_for(lambda: prefixed(runner, "calm") == ["up"], timeout=30, what="calm up")
    runner.send(signal.SIGINT)
    wait_system_line(runner, "calm stopped (rc=0)")
    wait_for(
        lambda: prefixed(runner, "stubborn") == ["up", "got SIGTERM"],
        timeout=30,
        what="stubborn to get its one SIGTERM",
    )
    runner.send(signal.SIGINT)
    assert runner.wait(timeout=30) == 1
    system = prefixed(runner, "system")
    assert "SIGINT received again: killing what is left" in system
    assert any(line.startswith("sent SIGKILL to stubborn ") for line in system)
    assert f"stubborn stopped (rc={-signal.SIGKILL})" in system
    assert prefixed(runner, "stubborn") == ["up", "got SIGTERM"]  # exactly one SIGTERM
