"""The state machine as data, its drawing, and who may write the ledger."""

from __future__ import annotations

import re
from pathlib import Path

from ledger.states import ALLOWED_TRANSITIONS, STATUSES

ROOT = Path(__file__).resolve().parents[2]


def drawn_transitions() -> dict[tuple[str, str], set[str]]:
    text = (ROOT / "docs" / "state_machine.md").read_text()
    edges: dict[tuple[str, str], set[str]] = {}
    for src, dst, label in re.findall(r"^\s+(\w+) --> (\w+): (.+)$", text, re.MULTILINE):
        if src != "[*]":
            edges[(src, dst)] = {part.strip() for part in label.split("/")}
    return edges


def test_drawing_and_data_agree() -> None:
    data = {edge: set(names) for edge, names in ALLOWED_TRANSITIONS.items()}
    assert drawn_transitions() == data


def test_every_status_is_reachable() -> None:
    reached = {dst for _, dst in ALLOWED_TRANSITIONS} | {"WAITING"}
    assert reached == set(STATUSES)


def test_only_the_ledger_writes_background_tasks() -> None:
    pattern = re.compile(r"(UPDATE|INSERT INTO|DELETE FROM)\s+background_tasks", re.IGNORECASE)
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        # tests, the benchmark, the soak and the helpers they share (harness) seed and age
        # rows on purpose
        if rel.parts[0] in {"ledger", "tests", "bench", "soak", "harness", ".venv", "build"}:
            continue
        if pattern.search(path.read_text()):
            offenders.append(str(rel))
    assert offenders == []
