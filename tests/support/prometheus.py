"""A real Prometheus server (Debian's ``prometheus``, installed by ``make test``) for the
process tests: scrapes loopback targets every second and evaluates the project's alert
rules every second, queried through its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from harness.processes import ROOT, Proc, free_port

ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
INTERVAL = "1s"


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:  # make test installs it (scripts/ensure_debian.sh prometheus prometheus)
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "ensure_debian.sh"), "prometheus", "prometheus"],
            check=True,
        )
        found = shutil.which("prometheus")
    assert found, "Debian's prometheus is not on PATH"
    return found


def config(jobs: dict[str, list[str]], rules: Path = ALERTS) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ],
    }


class Prometheus:
    def __init__(self, work: Path, jobs: dict[str, list[str]]) -> None:
        self.targets = {target for targets in jobs.values() for target in targets}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        conf = work / "prometheus.yml"
        conf.write_text(yaml.safe_dump(config(jobs)))
        argv = [
            binary(),
            f"--config.file={conf}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc = Proc("prometheus", argv, {"PATH": "/usr/bin:/bin"}, work)

    def start(self) -> Prometheus:
        self.proc.start()
        return self

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def scraped_every_target(self) -> bool:
        """Every configured target has been scraped at least once (up or down). Prometheus
        hands its scrape loops their targets about 5 s after it is ready, then staggers
        their first scrapes over an interval: until then a job has no ``up`` at all."""
        if not self.ready():
            return False
        active = self.get("/api/v1/targets", state="active")["activeTargets"]
        scraped = {t["labels"]["instance"] for t in active if t["health"] != "unknown"}
        return scraped == self.targets

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query: each series' labels (sorted, no __name__) -> value."""
        data = self.get("/api/v1/query", query=expr)
        return {
            tuple(sorted((k, v) for k, v in item["metric"].items() if k != "__name__")): float(
                item["value"][1]
            )
            for item in data["result"]
        }

    def scalar(self, expr: str) -> float | None:
        values = list(self.query(expr).values())
        assert len(values) <= 1, values
        return values[0] if values else None

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def targets_up(self) -> dict[str, float]:
        return {dict(k)["job"]: v for k, v in self.query("min by (job) (up)").items()}
