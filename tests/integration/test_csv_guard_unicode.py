"""The CSV formula guard as a rule over Unicode's data (issue "Security, round four",
finding 6), in PostgreSQL: the export's title cell (``tasks.export.guard().title_cell``, the
expression inside its COPY) neutralises a formula after any leading control, format
character, space, separator, non-spacing mark or Hangul filler, and a formula started by
MINUS SIGN or any character whose NFKC form is ``= + - @ |``; it agrees with the
reference (harness/csv_reference.py) on every such character; and a real export carries
the characters the review found missing (tests/integration/test_csv_guard.py: the rest of
the CSV contract)."""

from __future__ import annotations

import csv
import io
import sys
import unicodedata
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from celery import Celery

from harness.csv_reference import expected_csv, neutralised
from harness.factories import World, add_ticket, task_row
from harness.waiting import wait_for
from ledger import service
from tasks.export import guard
from tests.support.dispatching import running_cluster

MISSED_SKIPPED = [
    "\u061c",  # ARABIC LETTER MARK
    "\u034f",  # COMBINING GRAPHEME JOINER
    "\u115f",  # HANGUL CHOSEONG FILLER
    "\u17b4",  # KHMER VOWEL INHERENT AQ
    "\u180b",  # MONGOLIAN FREE VARIATION SELECTOR ONE
    "\u3164",  # HANGUL FILLER
    "\ufe0f",  # VARIATION SELECTOR-16
    "\uffa0",  # HALFWIDTH HANGUL FILLER
    "\U000e0020",  # TAG SPACE
    "\ufff9",  # INTERLINEAR ANNOTATION ANCHOR
]
MISSED_STARTS = ["\u2212", "\ufe62", "\ufe63", "\ufe66"]  # MINUS SIGN; SMALL + - =
FORMULAS = ["=1+1", "+1", "-1", "@SUM(A1)"]
SKIPPED_CATEGORIES = ("Cf", "Mn", "Zs", "Zl", "Zp", "Cc")
HANGUL_FILLERS = "\u115f\u1160\u3164\uffa0"


def cells(engine: sa.Engine, titles: list[str]) -> list[str]:
    """The export's title cell for each title, computed by PostgreSQL."""
    query = (
        f"SELECT {guard().title_cell}"
        " FROM unnest(%(titles)s::text[]) WITH ORDINALITY AS t(title, n) ORDER BY n"
    )
    with engine.connect() as conn:
        return [row[0] for row in conn.exec_driver_sql(query, {"titles": titles})]


def wrong(engine: sa.Engine, titles: list[str], dangerous: bool) -> list[str]:
    """The titles whose cell is not what ``dangerous`` says (as code points, readable)."""
    got = cells(engine, titles)
    return [
        " ".join(f"U+{ord(ch):04X}" for ch in title)
        for title, cell in zip(titles, got, strict=True)
        if cell != ("'" + title if dangerous else title)
    ]


def test_a_formula_after_a_missed_character_is_neutralised(engine: sa.Engine) -> None:
    titles = [ch + formula for ch in MISSED_SKIPPED for formula in FORMULAS]
    titles += [ch + start + "1" for ch in MISSED_SKIPPED for start in MISSED_STARTS]
    titles += [" " + ch + "\u200b" + ch + "=1" for ch in MISSED_SKIPPED]
    assert wrong(engine, titles, dangerous=True) == []
    assert wrong(engine, [ch + "Printer jams" for ch in MISSED_SKIPPED], dangerous=False) == []


def test_a_missed_formula_start_is_neutralised(engine: sa.Engine) -> None:
    titles = [start + "1" for start in MISSED_STARTS]
    titles += [" \u3000" + start + "A1" for start in MISSED_STARTS]
    assert wrong(engine, titles, dangerous=True) == []
    assert wrong(engine, ["a" + start + "1" for start in MISSED_STARTS], dangerous=False) == []


def _every(wanted: tuple[str, ...]) -> list[str]:
    return [chr(c) for c in range(1, sys.maxunicode + 1) if unicodedata.category(chr(c)) in wanted]


def test_every_skipped_category_character_before_a_formula_is_neutralised(
    engine: sa.Engine,
) -> None:
    leads = _every(SKIPPED_CATEGORIES) + list(HANGUL_FILLERS)
    assert len(leads) > 2000
    for formula in ("=2+2", "\u22121", "\uff0b1"):
        assert wrong(engine, [ch + formula for ch in leads], dangerous=True) == []
    # ... and harmless text after them is left alone (TAB, CR and LF neutralise anything).
    plain = [ch + "Printer jams" for ch in leads if ch not in "\t\r\n"]
    assert wrong(engine, plain, dangerous=False) == []


def test_every_character_whose_nfkc_form_starts_a_formula_is_neutralised(
    engine: sa.Engine,
) -> None:
    starts = [
        chr(c)
        for c in range(1, sys.maxunicode + 1)
        if unicodedata.normalize("NFKC", chr(c)).startswith(("=", "+", "-", "@", "|", "\u2212"))
    ]
    assert set(MISSED_STARTS) <= set(starts)
    assert wrong(engine, [ch + "1" for ch in starts], dangerous=True) == []
    assert wrong(engine, ["\ufe0f" + ch + "1" for ch in starts], dangerous=True) == []


@pytest.mark.parametrize("formula", ["=2+2", "x", "\u2212", "\ufe66"])
def test_the_sql_agrees_with_the_reference_on_every_leading_character(
    engine: sa.Engine, formula: str
) -> None:
    """Every code point PostgreSQL's text can hold, as a title's first character."""
    titles = [
        chr(c) + formula
        for c in range(1, sys.maxunicode + 1)
        if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) != "Cn"
    ]
    got = cells(engine, titles)
    disagree = [
        f"U+{ord(title[0]):04X}"
        for title, cell in zip(titles, got, strict=True)
        if cell != neutralised(title)
    ]
    assert disagree == []


def test_an_export_neutralises_the_missed_characters(
    engine: sa.Engine, world: World, celery_app: Celery
) -> None:
    titles = [ch + "=1+1" for ch in MISSED_SKIPPED] + [s + "1" for s in MISSED_STARTS]
    harmless = [ch + "Printer jams" for ch in MISSED_SKIPPED]
    base = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    with engine.begin() as conn:
        for i, title in enumerate(titles + harmless):
            at = base + timedelta(minutes=i)
            add_ticket(conn, world.team_id, world.customer_id, title, created_at=at)
        task_id = service.create_export(conn, world.team_id, world.staff_id, "TEAM", {})
    with running_cluster(celery_app):
        wait_for(
            lambda: task_row(engine, task_id)["status"] in ("COMPLETED", "FAILED"),
            what="the export to end",
        )
    row = task_row(engine, task_id)
    assert row["status"] == "COMPLETED", row
    text = str(row["result_csv"])
    records = list(csv.reader(io.StringIO(text, newline="")))[1:]
    assert [r[1] for r in records] == ["'" + t for t in titles] + harmless
    assert text == expected_csv(engine, world.team_id, world.staff_id, "TEAM", {})
