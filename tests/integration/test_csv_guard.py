"""The CSV's formula guard (issue 25, finding 3), through a real export (an in-process
worker and dispatcher): a title whose first character after leading blank or invisible
characters could start a formula gets a leading ``'``, every non-NULL field of every
record is quoted (so a locale that splits on ``;`` never sees a cell starting with
``=``), and harmless titles come back as they are."""

from __future__ import annotations

import csv
import io
import re
import sys
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from celery import Celery

from harness.csv_reference import expected_csv
from harness.factories import World, add_ticket, task_row
from harness.waiting import wait_for
from ledger import service
from tests.support.dispatching import running_cluster

HEADER = "id,title,status,priority,requester_id,assignee_id,due_at,created_at,updated_at"

# Reproduced misses of the old guard (first character only), plus the starts it did catch.
DANGEROUS = [
    " =1+1",
    "\n=1+1",
    "\x0b=",
    "\x0c=",
    "\xa0=",
    "\ufeff=",
    "\u200b=",
    "\u200c=",
    "\u200d=",
    "\u2060=",
    "\u3000=",
    "\u2003=1",  # EM SPACE
    "\x1c=1",  # a C0 separator Python counts as whitespace
    "\x85=1",  # NEL
    "\uff1d1+1",  # FULLWIDTH EQUALS SIGN
    "\uff0b1",  # FULLWIDTH PLUS SIGN
    "\uff0d1",  # FULLWIDTH HYPHEN-MINUS
    "\uff20x",  # FULLWIDTH COMMERCIAL AT
    "|calc",
    " \t |calc",
    "=1+1",
    "+1",
    "-1",
    "@SUM(A1)",
    "\t=1",
    "\r=1",
    "\tindented",  # a leading TAB, CR or LF is neutralised whatever follows
    "\nnext line",
]
# Every character Python counts as whitespace, and the zero-width ones, before an '='.
DANGEROUS += [
    ch + "=2+2"
    for ch in map(chr, range(sys.maxunicode + 1))
    if ch.isspace() or ch in "\u200b\u200c\u200d\u2060\ufeff"
]
HARMLESS = [
    "Printer jams",
    "a=b",
    "a;b",
    "Total: -5",
    "x@y.example",
    "caf\u00e9 \u2603",
    "",
]
# No comma, quote or newline: PostgreSQL's CSV left these unquoted, and a spreadsheet
# locale that splits on ';' made a cell starting with '='.
SEMICOLON = ['a;=HYPERLINK("http://x")', "a;=1+1"]

QUOTED = r'"(?:[^"]|"")*"'
# A record: 9 fields, each quoted or empty (NULL), ended by LF.
RECORD = re.compile(rf"(?:{QUOTED})?(?:,(?:{QUOTED})?){{8}}\n")


def test_every_formula_start_is_neutralised_and_every_field_is_quoted(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    titles = DANGEROUS + HARMLESS + SEMICOLON
    base = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    ids: list[uuid.UUID] = []
    with engine.begin() as conn:
        for i, title in enumerate(titles):
            ids.append(
                add_ticket(
                    conn,
                    world.team_id,
                    world.customer_id,
                    title,
                    created_at=base + timedelta(minutes=i),
                    # Half the rows with NULL cells, half without.
                    assignee_id=world.staff_id if i % 2 else None,
                    due_at=base if i % 2 else None,
                )
            )
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with running_cluster(celery_app):
        wait_for(
            lambda: task_row(engine, task_id)["status"] in ("COMPLETED", "FAILED"),
            what="the export to end",
        )
    row = task_row(engine, task_id)
    assert (row["status"], row["result_summary"]) == ("COMPLETED", f"{len(titles)} rows")
    text = str(row["result_csv"])

    # Parsed: every title cell as expected, every other cell what the ticket holds.
    records = list(csv.reader(io.StringIO(text, newline="")))
    assert records[0] == HEADER.split(",")
    body = records[1:]
    assert len(body) == len(titles)
    wrong = [
        (title, cells[1])
        for title, cells in zip(titles, body, strict=True)
        if cells[1] != ("'" + title if title in DANGEROUS else title)
    ]
    assert wrong == []
    for i, cells in enumerate(body):
        stamp = (base + timedelta(minutes=i)).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert cells[0] == str(ids[i])
        assert cells[2:5] == ["OPEN", "NORMAL", str(world.customer_id)]
        assert cells[5:7] == ([str(world.staff_id), "2026-03-01T12:00:00Z"] if i % 2 else ["", ""])
        assert cells[7:] == [stamp, stamp]

    # Raw: the header as the contract writes it, then records whose every field is quoted
    # (NULL alone is an empty, unquoted field).
    assert text.startswith(HEADER + "\n")
    pos, raw_records = len(HEADER) + 1, []
    while pos < len(text):
        match = RECORD.match(text, pos)
        assert match is not None, f"record with an unquoted field at {text[pos : pos + 120]!r}"
        raw_records.append(match.group())
        pos = match.end()
    assert len(raw_records) == len(titles)
    for i, record in enumerate(raw_records):
        fields = [quoted for quoted, _ in re.findall(rf"({QUOTED})?(,|\n)", record)]
        assert len(fields) == 9, record
        nulls = [n for n, f in enumerate(fields) if f == ""]
        assert nulls == ([] if i % 2 else [5, 6]), record
    for title in SEMICOLON:
        assert ',"' + title.replace('"', '""') + '",' in text
    assert ',"",' in text  # an empty title is still an empty quoted text, not NULL

    # The reference the other export tests compare with agrees byte for byte.
    assert text == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
