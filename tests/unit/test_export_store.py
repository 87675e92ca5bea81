"""EXPORT_STORE and EXPORT_DOWNLOAD (teamdesk/export_store.py, teamdesk/config.py): what an
operator may write, the one-line refusal of anything else, and the object keys' form."""

from __future__ import annotations

import uuid

import pytest

from teamdesk import export_store
from teamdesk.config import ConfigError, load_settings
from teamdesk.export_store import MSG_STORE, ObjectLocation, StoreTarget


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        ("", "postgres"),
        ("postgres", "postgres"),
        ("Postgres", "postgres"),
        ("s3://teamdesk-exports", "s3://teamdesk-exports/"),
        ("s3://teamdesk-exports/", "s3://teamdesk-exports/"),
        ("s3://teamdesk.exports/prod/eu-1", "s3://teamdesk.exports/prod/eu-1/"),
        ("s3://abc//a//b/", "s3://abc/a/b/"),
    ],
)
def test_the_stores_an_operator_may_name(value: str, stored: str) -> None:
    assert load_settings({"EXPORT_STORE": value}).export_store == stored


@pytest.mark.parametrize(
    "value",
    [
        "s3://",
        "s3://ab",
        "s3://Upper",
        "s3://-lead",
        "s3://b_ucket",
        "file:///tmp",
        "s3://abc/a b",
        "s3://abc/../x",
        "gs://abc",
        "S3://abc",
    ],
)
def test_anything_else_is_refused_with_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings({"EXPORT_STORE": value})
    assert str(refused.value) == MSG_STORE.format(value=value)


def test_a_redirect_needs_an_object_store_and_a_known_mode() -> None:
    assert load_settings({}).export_download == "stream"
    both = {"EXPORT_STORE": "s3://abc", "EXPORT_DOWNLOAD": "Redirect"}
    assert load_settings(both).export_download == "redirect"
    with pytest.raises(ConfigError, match="EXPORT_DOWNLOAD=redirect needs an object store"):
        load_settings({"EXPORT_DOWNLOAD": "redirect"})
    with pytest.raises(ConfigError, match=r"EXPORT_DOWNLOAD must be one of stream\|redirect"):
        load_settings({"EXPORT_STORE": "s3://abc", "EXPORT_DOWNLOAD": "proxy"})


def test_an_object_key_names_its_task_and_execution_and_cannot_be_guessed() -> None:
    target = StoreTarget("abc", "prod/")
    task, execution = uuid.uuid4(), uuid.uuid4()
    keys = {export_store.object_key(target, task, execution) for _ in range(50)}
    assert len(keys) == 50  # 128 random bits each
    for key in keys:
        assert key.startswith(f"prod/exports/{task}/{execution}-") and key.endswith(".csv")
        assert export_store.names_of(key) == (task, execution)
    assert export_store.names_of(f"prod/exports/{task}/{execution}.csv") is None
    assert export_store.names_of("prod/exports/readme.txt") is None


def test_a_location_is_its_url() -> None:
    location = ObjectLocation.parse("s3://abc/prod/exports/x.csv")
    assert location == ObjectLocation("abc", "prod/exports/x.csv")
    assert location.url == "s3://abc/prod/exports/x.csv"
    with pytest.raises(ValueError):
        ObjectLocation.parse("s3://abc")
