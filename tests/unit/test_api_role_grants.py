"""The API's database role names every project table (ledger/api_database_role.py): a table added
to ``ledger.models`` must be given the API's privileges on it, or explicitly none, before
the role is set up again; and every column a privilege names exists."""

from __future__ import annotations

from ledger.api_database_role import API_TABLES, CREATED_COLUMNS, READ_COLUMNS, REOPENED_COLUMNS
from ledger.models import metadata


def test_every_table_of_the_models_has_an_api_decision() -> None:
    assert set(API_TABLES) == {table.name for table in metadata.sorted_tables}


def test_column_privileges_name_existing_columns() -> None:
    tables = {table.name: table for table in metadata.sorted_tables}
    named = {
        (name, column)
        for name, privileges in API_TABLES.items()
        for privilege in privileges
        for column in privilege.columns
    }
    assert named == {
        ("tickets", "id"),
        ("tickets", "team_id"),
        *(("background_tasks", c) for c in CREATED_COLUMNS + REOPENED_COLUMNS + READ_COLUMNS),
    }
    assert all(column in tables[name].c for name, column in named)


def test_the_api_may_write_no_result_of_a_task() -> None:
    """A CSV, its key, checksum and size are the worker's to write: never the API's
    (issue "Security, round four", finding 4)."""
    results = {"result_csv", "result_key", "result_sha256", "result_bytes", "result_object"}
    assert not results & set(CREATED_COLUMNS + REOPENED_COLUMNS)
    assert {"team_id", "owner_id", "filters", "scope", "kind"}.isdisjoint(REOPENED_COLUMNS)


def test_the_api_reads_no_csv_nor_token_but_through_the_owners_functions() -> None:
    """The same finding: no SELECT of a CSV (chunks, or the row's own column) nor of the
    tokens' hashes; downloads and token lookups go through migration 0014's functions."""
    assert API_TABLES["export_chunks"] == () and API_TABLES["api_tokens"] == ()
    assert {c.name for c in metadata.tables["background_tasks"].c} - set(READ_COLUMNS) == {
        "result_csv",
        "result_object",
    }
