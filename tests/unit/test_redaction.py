"""The redactor (teamdesk/redaction.py), by property: whatever a password, a token or a
query secret holds - ``@ : / ?`` included - none of it survives in a log line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.tokens import TOKEN_PREFIX
from teamdesk.redaction import API_TOKEN_PREFIX, REDACTED, redact, redact_text

# A distinctive head (so a match can only be the secret itself), then anything a user
# might type into a password, URL-significant characters first among them.
SECRET = st.builds(
    lambda tail: "Zq9" + tail,
    st.text(
        alphabet=st.sampled_from("@:/?#&=%+!$*abcXYZ019-_."),
        min_size=1,
        max_size=24,
    ),
)


@given(password=SECRET)
def test_a_url_password_never_survives(password: str) -> None:
    for url in (
        f"redis://:{password}@cache:6379/0",
        f"postgresql://app:{password}@db:5432/teamdesk",
        f"amqp://guest:{password}@mq:5672/teamdesk",
    ):
        line = redact_text(f"connect to {url} failed")
        assert password not in line and REDACTED in line, line
        assert line.startswith("connect to ") and line.endswith(" failed")


@given(password=SECRET)
def test_a_key_value_password_never_survives(password: str) -> None:
    for dsn in (
        f"host=db password={password} dbname=teamdesk",
        f"host=db password='{password}' dbname=teamdesk",
        f"PASSWORD = {password}",
        f"PGPASSWORD={password} psql -h db",
        f"REDIS_PASSWORD='{password}' redis-cli",
        f"password: {password}",
        f"X-Api-Key: {password}",
        f"client_secret={password}",
        f'{{"password": "{password}"}}'.replace('"', "") + " end",
    ):
        line = redact_text(dsn)
        assert password not in line and REDACTED in line, line


@given(secret=SECRET)
def test_a_secret_query_parameter_never_survives(secret: str) -> None:
    value = secret.replace("&", "").replace("#", "")  # those end a query value
    for query in ("?access_token=", "?token=", "&api_key=", "?x=1&password="):
        line = redact_text(f'"GET /api/tasks/1{query}{value} HTTP/1.1" 401')
        assert value not in line and REDACTED in line, line


@given(secret=st.text(alphabet="abcXYZ019-_", min_size=8, max_size=43))
def test_an_api_token_never_survives_anywhere(secret: str) -> None:
    token = TOKEN_PREFIX + secret
    for text in (token, f"bad token {token}.", f"x={token}", f"Authorization: Bearer {token}"):
        assert secret not in redact_text(text)


def test_the_api_token_prefix_is_the_ledgers() -> None:
    assert API_TOKEN_PREFIX == TOKEN_PREFIX


@pytest.mark.parametrize(
    "text",
    [
        "redis://127.0.0.1:6379/0",
        "postgresql://u@h/db",
        "GET /api/tasks/3f1c?limit=10 HTTP/1.1",
        "12 rows; password policy unchanged",
    ],
)
def test_text_without_credentials_is_unchanged(text: str) -> None:
    assert redact_text(text) == text


def test_secret_named_fields_are_replaced_whole_at_any_depth() -> None:
    assert redact(
        {"headers": {"Authorization": "x", "Accept": "text/csv"}, "db_pwd": "x", "n": 3}
    ) == {"headers": {"Authorization": REDACTED, "Accept": "text/csv"}, "db_pwd": REDACTED, "n": 3}
