"""The reference pages in docs/ list what the code defines, no more and no less.

Each list is read from the code's own structures, not from its source text: the settings
from what ``load_settings`` reads and the ``Settings`` it returns, the commands from the
CLI's parser, the routes from the API's OpenAPI schema, the metrics from the registries
(as tests/unit/test_metrics_names.py collects them) and the alerts from
deploy/prometheus/alerts.yaml. Only the few variables read outside ``Settings`` (the local
cluster's, the tests') are looked for in the source. No service is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from teamdesk import metrics
from teamdesk.config import Settings, load_settings
from tests.unit.test_metrics_names import exported

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE_SPAN = re.compile(r"`([^`]+)`")


# --- reading the pages ---------------------------------------------------------------


def section(page: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    text = (DOCS / page).read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    bodies = {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    assert heading in bodies, f"docs/{page} has no '## {heading}'"
    return bodies[heading]


def table(text: str) -> list[list[str]]:
    """The cells of the first Markdown table in ``text``, header and rule left out (an
    escaped ``\\|`` stays inside its cell)."""
    rows = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("|"):
            next(lines)  # the |---| rule under the header
            break
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    assert rows, "no table found"
    return rows


def spans(cell: str) -> list[str]:
    return CODE_SPAN.findall(cell)


# --- docs/configuration.md -----------------------------------------------------------


class Recording(Mapping[str, str]):
    """An empty environment that remembers every variable asked for (``get`` and ``in``
    go through ``__getitem__``)."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def settings_table() -> dict[str, str]:
    """Variable -> the text of its default cell, from the "Settings" table."""
    documented: dict[str, str] = {}
    for cells in table(section("configuration.md", "Settings")):
        names = spans(cells[0])
        assert len(names) == 1, f"one variable per row: {cells[0]}"
        assert names[0] not in documented, f"{names[0]} is listed twice"
        documented[names[0]] = cells[1]
    return documented


def read_by_load_settings() -> set[str]:
    env = Recording()
    load_settings(env)
    return env.asked


def test_the_settings_table_lists_every_variable_the_code_reads_and_no_other() -> None:
    documented = set(settings_table())
    read = read_by_load_settings()
    assert sorted(read - documented) == [], "read by load_settings, not in the table"
    assert sorted(documented - read) == [], "in the table, not read by load_settings"


def test_every_setting_is_a_field_of_settings_named_like_its_variable() -> None:
    """The defaults below are compared field by field: each variable must have its field."""
    fields = {field.name.upper() for field in dataclasses.fields(Settings)}
    assert fields == read_by_load_settings()


# A field whose raw value stands for another variable's ("" for DISPATCH_LISTEN_URL:
# DATABASE_URL's): compare what the code uses, the property.
RESOLVED = {"dispatch_listen_url": "listen_url"}
UNSET = "unset"


def used(settings: Settings, variable: str) -> Any:
    field = variable.lower()
    return getattr(settings, RESOLVED.get(field, field))


def documented_defaults() -> Iterator[tuple[str, str]]:
    for variable, cell in settings_table().items():
        if cell == UNSET:
            yield variable, UNSET
            continue
        values = spans(cell)
        if cell == "hostname":  # the machine's name, as WORKER_INSTANCE_ID's
            values = [socket.gethostname()]
        assert len(values) == 1, f"{variable}: default {cell!r} is not one `value` or unset"
        yield variable, values[0]


@pytest.mark.parametrize(("variable", "default"), list(documented_defaults()))
def test_each_setting_has_the_default_the_table_says(variable: str, default: str) -> None:
    """Setting a variable to its documented default changes nothing; a default naming
    another variable follows that variable; "unset" is the empty value."""
    plain = load_settings({})
    documented = settings_table()
    if default == UNSET:
        assert used(plain, variable) in ("", None)
        assert load_settings({variable: ""}) == plain
    elif default in documented:  # e.g. BROKER_URL: REDIS_URL
        other = default
        sample = spans(documented[other])[0].replace("127.0.0.1", "docs-check.example")
        assert sample != used(plain, other), f"{other}'s default has no 127.0.0.1 to change"
        assert used(load_settings({other: sample}), variable) == sample
    else:
        assert load_settings({variable: default}) == plain


def command_only_table() -> set[str]:
    names: set[str] = set()
    for cells in table(section("configuration.md", "Read by one command only")):
        names.update(spans(cells[0]))
    return names


def test_the_command_only_table_lists_the_passwords_migrate_and_redis_acl_read() -> None:
    from cli.main import API_PASSWORD_VAR, APP_PASSWORD_VAR
    from teamdesk.redis_acl import PASSWORD_VARS

    assert command_only_table() == {APP_PASSWORD_VAR, API_PASSWORD_VAR, *PASSWORD_VARS.values()}


def test_the_other_variables_are_read_by_the_code_and_are_no_settings() -> None:
    others: set[str] = set()
    others_section = section("configuration.md", "The local cluster, the API server and the tests")
    for cells in table(others_section):
        others.update(name for name in spans(cells[0]) if name.isupper())
    assert others
    settings = set(settings_table())
    assert not others & (settings | command_only_table())
    packages = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sources = [ROOT / "Makefile", *(f for p in packages for f in p.rglob("*.py"))]
    code = "\n".join(path.read_text() for path in sources if path != Path(__file__))
    assert sorted(name for name in others if not re.search(rf"\b{name}\b", code)) == []


# --- docs/operations.md: the teamdesk-tasks commands ---------------------------------

Command = tuple[str, str | None]  # (command, subcommand)


def parser_commands() -> dict[Command, set[str]]:
    """Every command (and subcommand) of ``teamdesk-tasks`` with its options."""
    from cli.main import build_parser

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def options(parser: argparse.ArgumentParser) -> set[str]:
        found = {o for action in parser._actions for o in action.option_strings}
        return {o for o in found if o.startswith("--")} - {"--help"}

    out: dict[Command, set[str]] = {}
    for name, command in subparsers(build_parser()).items():
        subs = subparsers(command)
        for sub, parser in subs.items():
            out[(name, sub)] = options(command) | options(parser)
        if not subs:
            out[(name, None)] = options(command)
    return out


def documented_commands() -> dict[Command, set[str]]:
    """The commands of the table: each code span of the first column is one command
    line, ``name [subcommand] ARGS [--option ...]``."""
    known = parser_commands()
    with_subcommands = {name for name, sub in known if sub is not None}
    out: dict[Command, set[str]] = {}
    for cells in table(section("operations.md", "Commands")):
        for line in spans(cells[0]):
            words = line.split()
            sub = words[1] if words[0] in with_subcommands else None
            out.setdefault((words[0], sub), set()).update(re.findall(r"--[a-z][a-z-]*", line))
    return out


def test_the_commands_table_lists_every_command_and_option_of_the_cli_and_no_other() -> None:
    documented = documented_commands()
    known = parser_commands()
    assert sorted(documented, key=str) == sorted(known, key=str)
    for command, options in known.items():
        assert documented[command] == options, command


# --- docs/api.md: the routes ---------------------------------------------------------

ROUTE = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (/\S*)$")


def test_the_route_table_lists_every_route_of_the_api_and_no_other() -> None:
    from api.app import create_api

    schema = create_api(Settings(), configure_logging=False).openapi()
    served = {(m.upper(), path) for path, item in schema["paths"].items() for m in item}
    documented = set()
    for cells in table(section("api.md", "Routes")):
        for span in spans(cells[0]):
            match = ROUTE.match(span)
            if match:
                documented.add((match.group(1), match.group(2)))
    assert sorted(documented) == sorted(served)


# --- docs/observability.md: the metrics and the alerts ------------------------------

METRIC = re.compile(r"\b(teamdesk_[a-z_]+)(?:\{([a-z_,]+)\})?")


def registered_labels() -> dict[str, tuple[str, ...]]:
    """Label names of the metrics created with labels (a labelled metric without samples
    yet shows none in its samples, so they are read from the metric objects)."""
    worker = metrics.REGISTRY.__class__()
    metrics.TaskMetrics(worker)
    out = {}
    for registry in (worker, metrics.REGISTRY):
        for collector in list(registry._collector_to_names):
            if isinstance(collector, MetricWrapperBase):
                out[collector._name] = tuple(collector._labelnames)
    return out


def code_metrics() -> dict[str, set[str]]:
    """Name as the page writes it (a counter with ``_total``) -> its label names."""
    labels = registered_labels()
    out = {}
    for name, (kind, sampled) in exported().items():
        shown = f"{name}_total" if kind == "counter" else name
        out[shown] = set(labels.get(name, sampled))
    return out


def page_metrics() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for cells in table(section("observability.md", "Metrics")):
        for name, labels in METRIC.findall(" ".join(cells)):
            named = set(labels.split(",")) if labels else set()
            assert out.get(name, named) == named, f"{name} is shown with two label sets"
            out[name] = named
    return out


def test_the_metrics_table_lists_every_metric_of_the_code_and_no_other() -> None:
    assert sorted(page_metrics()) == sorted(code_metrics())


def test_the_metrics_table_shows_each_metrics_labels() -> None:
    code = code_metrics()
    assert {name: labels for name, labels in page_metrics().items() if name in code} == code


def test_the_alerts_table_lists_every_rule_with_its_severity_and_no_other() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    defined = {
        rule["alert"]: rule["labels"]["severity"]
        for group in rules["groups"]
        for rule in group["rules"]
    }
    documented = {}
    for cells in table(section("observability.md", "Alerts")):
        (name,) = spans(cells[0])
        documented[name] = cells[-1]
    assert documented == defined
