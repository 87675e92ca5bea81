"""The API's database role names every project table (ledger/api_role.py): a table added
to ``ledger.models`` must be given the API's privileges on it, or explicitly none, before
the role is set up again; and every column a privilege names exists."""

from __future__ import annotations

from ledger.api_role import API_TABLES
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
    assert named == {("api_tokens", "last_used_at"), ("tickets", "id"), ("tickets", "team_id")}
    assert all(column in tables[name].c for name, column in named)
