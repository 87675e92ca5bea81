"""Why a server could not be used, in words an operator can act on, read from libpq's and
redis-py's error text (``connection refused at 127.0.0.1:5433``); redacted all the same,
else the text's first line or the exception's class (docs/design.md, "Logs").
"""

from __future__ import annotations

import re

from teamdesk.redaction import redact_text

# libpq: 'connection to server at "db" (10.0.0.5), port 5432 failed: <reason>'
_PG_SERVER = re.compile(r'connection to server at "([^"]+)"(?: \([^)]*\))?, port (\d+) failed: ')
_PG_SOCKET = re.compile(r'connection to server on socket "([^"]+)" failed: ')
_PG_LEVEL = re.compile(r"^(FATAL|ERROR):\s+")
# redis-py: 'Error 111 connecting to 127.0.0.1:6390. Connection refused.'
_REDIS_CONNECT = re.compile(r"Error \d+ connecting to ([^\s]+?)\. (.*?)\.?$")
_REDIS_TIMEOUT = re.compile(r"Timeout connecting to server")
MAX_CAUSE = 200
DATABASE_HINT = "check DATABASE_URL and that PostgreSQL is running"


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _kept(cause: str, exc: BaseException) -> str:
    cause = redact_text(cause.strip())[:MAX_CAUSE]
    return cause or type(exc).__name__


def database_failure(exc: BaseException) -> str:
    """The cause of a PostgreSQL error (SQLAlchemy's wrapper or psycopg2's own)."""
    text = str(getattr(exc, "orig", None) or exc)
    where = None
    for pattern in (_PG_SERVER, _PG_SOCKET):
        match = pattern.search(text)
        if match:
            where = ":".join(match.groups())
            text = text[match.end() :]
            break
    line = _first_line(text)
    reason = _PG_LEVEL.sub("", line)
    if where is None or reason != line:  # the server answered (FATAL: ...): it says why
        return _kept(reason, exc)
    if reason.lower().startswith("timeout expired"):
        return _kept(f"no answer from {where} (timeout)", exc)
    return _kept(f"{reason[:1].lower()}{reason[1:]} at {where}", exc)


def database_unusable(exc: BaseException) -> str:
    """The line every command prints when PostgreSQL cannot be used (``status``, ``scan``,
    ``health --cluster``...): the cause, and where to look."""
    return f"cannot use PostgreSQL: {database_failure(exc)}; {DATABASE_HINT}"


def redis_failure(exc: BaseException) -> str:
    """The cause of a redis-py error."""
    text = _first_line(str(exc))
    match = _REDIS_CONNECT.search(text)
    if match:
        where, reason = match.groups()
        return _kept(f"{reason.lower()} at {where}", exc)
    if _REDIS_TIMEOUT.search(text):
        return _kept("no answer (timeout)", exc)
    if type(exc).__name__ == "AuthenticationError":
        return _kept(f"authentication failed ({text.rstrip('.')})", exc)
    return _kept(text, exc)
