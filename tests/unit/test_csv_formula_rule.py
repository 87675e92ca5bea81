"""The CSV formula guard as a rule over Unicode's data (issue "Security, round four",
finding 6), without a database: the characters the export's SQL skips and treats as a
formula start (tasks/export.py) are exactly those of the reference's rule
(harness/csv_reference.py), over every code point, and the reference neutralises the
characters the review found missing. The SQL itself is run in
tests/integration/test_csv_guard_unicode.py."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest

from harness import csv_reference
from harness.csv_reference import neutralised
from tasks import export

# Skipped or drawn as nothing by a spreadsheet, missed by the old list.
MISSED_SKIPPED = [
    "\u061c",  # ARABIC LETTER MARK (Cf)
    "\u034f",  # COMBINING GRAPHEME JOINER (Mn)
    "\u115f",  # HANGUL CHOSEONG FILLER (Lo)
    "\u17b4",  # KHMER VOWEL INHERENT AQ (Mn)
    "\u180b",  # MONGOLIAN FREE VARIATION SELECTOR ONE (Mn)
    "\u3164",  # HANGUL FILLER (Lo)
    "\ufe0f",  # VARIATION SELECTOR-16 (Mn)
    "\uffa0",  # HALFWIDTH HANGUL FILLER (Lo)
    "\U000e0020",  # TAG SPACE (Cf)
    "\ufff9",  # INTERLINEAR ANNOTATION ANCHOR (Cf)
]
# Minus, plus and equals signs a spreadsheet may read as the ASCII ones, missed before.
MISSED_STARTS = ["\u2212", "\ufe62", "\ufe63", "\ufe66"]
EVERY_CODE_POINT = range(1, sys.maxunicode + 1)  # NUL: no PostgreSQL text holds it


def test_minus_sign_is_its_own_nfkc_form_so_it_is_named() -> None:
    assert unicodedata.normalize("NFKC", "\u2212") == "\u2212"
    assert "\u2212" in export.FORMULA_STARTS


@pytest.mark.parametrize("ch", MISSED_SKIPPED, ids=lambda ch: f"U+{ord(ch):04X}")
@pytest.mark.parametrize("start", ["=1+1", "+1", "-1", "@SUM(A1)", "\u22121", "\ufe661"])
def test_a_formula_after_a_missed_character_is_neutralised(ch: str, start: str) -> None:
    for title in (ch + start, ch + ch + start, " " + ch + start):
        assert neutralised(title) == "'" + title
    assert neutralised(ch + "Printer jams") == ch + "Printer jams"


@pytest.mark.parametrize("ch", MISSED_STARTS, ids=lambda ch: f"U+{ord(ch):04X}")
def test_a_missed_formula_start_is_neutralised(ch: str) -> None:
    for title in (ch + "1", "\u200b" + ch + "1", "\ufe0f" + ch + "A1", "\u3164" + ch + "1"):
        assert neutralised(title) == "'" + title
    assert neutralised("a" + ch + "1") == "a" + ch + "1"


def test_the_sql_skips_exactly_the_references_characters() -> None:
    expected = {code for code in EVERY_CODE_POINT if csv_reference.skipped(chr(code))}
    assert set(map(ord, export.guard().skipped)) == expected
    categories = {unicodedata.category(ch) for ch in export.guard().skipped}
    assert categories == {"Cc", "Cf", "Zs", "Zl", "Zp", "Mn", "Lo", "Cn"}  # fillers, reserved


def test_the_sql_starts_are_exactly_the_references() -> None:
    expected = {c for c in EVERY_CODE_POINT if csv_reference.starts_formula(chr(c))} | {9, 10, 13}
    assert set(map(ord, export.guard().starts)) == expected
    assert {ord(ch) for ch in MISSED_STARTS} <= expected


@pytest.mark.parametrize("category", ["Cf", "Mn", "Zs", "Zl", "Zp", "Cc"])
def test_every_character_of_the_skipped_categories_is_skipped(category: str) -> None:
    members = [chr(c) for c in EVERY_CODE_POINT if unicodedata.category(chr(c)) == category]
    assert members
    missed = [f"U+{ord(ch):04X}" for ch in members if neutralised(ch + "=2+2") == ch + "=2+2"]
    assert missed == []


def test_the_regex_class_lists_every_character_once_as_an_escape() -> None:
    text = export.regex_class("-=a\u0300\u0301\u0302\U000e0020]^\\")
    assert text == (
        "\\u002d\\u003d\\u005c-\\u005e\\u0061\\u0300-\\u0302\\U000e0020"
    )  # - = \ ] ^ a, the marks as one range
    escapes = re.findall(
        r"\\u[0-9a-f]{4}|\\U[0-9a-f]{8}|-", export.regex_class(export.guard().skipped)
    )
    assert "".join(escapes) == export.regex_class(export.guard().skipped)
    pattern = export.guard().title_cell.split("'")[1]  # the regex literal, up to its closing quote
    assert pattern.startswith("^[") and pattern.endswith("]")
    assert not set("%{}") & set(pattern)  # nothing for mogrify or str.format to see
