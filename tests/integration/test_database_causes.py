"""``health --cluster`` and ``scan`` say why PostgreSQL cannot be used, in the words
``status`` uses (teamdesk/failures.py): a missing database, a missing role, a refused port
- never the password. Before, ``health --cluster`` said "PostgreSQL does not answer" for
all of them and ``scan`` "cannot reach PostgreSQL (OperationalError)"."""

from __future__ import annotations

import io
import json
import uuid

import pytest

from cli.cluster_health import cluster_command
from dispatcher.command import scan_command
from teamdesk.config import Settings
from tests.support.queues import closed_port

HINT = "check DATABASE_URL and that PostgreSQL is running"


def broken_urls(settings: Settings) -> list[tuple[str, str]]:
    """(DATABASE_URL, the cause it should be reported with)."""
    base = settings.database_url.rsplit("/", 1)[0]
    name = f"nosuchdb_{uuid.uuid4().hex[:6]}"
    port = closed_port()
    return [
        (f"{base}/{name}", f'database "{name}" does not exist'),
        (
            base.replace("postgres@", "nobody:hunter2@", 1) + "/postgres",
            'role "nobody" does not exist',
        ),
        (
            f"postgresql://postgres:hunter2@127.0.0.1:{port}/teamdesk",
            f"connection refused at 127.0.0.1:{port}",
        ),
    ]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["no-database", "no-role", "refused"])
def test_health_cluster_names_why_postgresql_cannot_be_used(settings: Settings, case: int) -> None:
    url, cause = broken_urls(settings)[case]
    out, err = io.StringIO(), io.StringIO()

    code = cluster_command(settings.with_overrides(database_url=url), out, err)

    problem = f"cannot use PostgreSQL: {cause}; {HINT}"
    report = json.loads(out.getvalue())
    assert (code, report["database"], report["waiting"]) == (1, False, None)
    assert problem in report["problems"]
    assert f"teamdesk-tasks health --cluster: {problem}\n" in err.getvalue()
    assert "hunter2" not in out.getvalue() + err.getvalue()


@pytest.mark.parametrize("case", [0, 1, 2], ids=["no-database", "no-role", "refused"])
def test_scan_names_why_postgresql_cannot_be_used(settings: Settings, case: int) -> None:
    url, cause = broken_urls(settings)[case]
    out, err = io.StringIO(), io.StringIO()

    code = scan_command(settings.with_overrides(database_url=url), out=out, err=err)

    assert (code, out.getvalue()) == (1, "")
    assert err.getvalue() == f"teamdesk-tasks scan: cannot use PostgreSQL: {cause}; {HINT}\n"
    assert "hunter2" not in err.getvalue()
