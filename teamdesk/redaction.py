"""What a log line must never carry, removed on the way out (docs/design.md, "Logs").

Fields whose name says secret (password, token, cookie, authorization, ...) are replaced
whole. In free text: the password part of any URL (everything between ``user:`` and the
last ``@`` of the word, so a password holding ``@``, ``:``, ``/`` or ``?`` is hidden
whole; a little more than the password may go with it, never less), the value after any
key that names a secret and ``=`` or ``:`` (``password=...`` in key=value connection
strings, ``PGPASSWORD=...``, ``password: ...``, ``X-Api-Key: ...``), secret-named query
parameters (``?access_token=...``), ``Bearer``/``Basic`` credentials and the API's own
tokens (``tdk_...``) wherever they appear.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "[REDACTED]"
API_TOKEN_PREFIX = "tdk_"  # ledger/tokens.py TOKEN_PREFIX (the foundation imports no ledger)

_SECRET_NAME = r"password|passwd|pwd|secret|token|cookie|authorization|api[_-]?key"
_SECRET_KEY = re.compile(_SECRET_NAME, re.IGNORECASE)
# scheme://user:password@ - greedy up to the last "@" before whitespace.
_URL_CREDENTIALS = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s]*):\S*@")
# password=... in libpq-style "key=value" strings (quoted or not), and any key that names a
# secret, alone or inside a longer name, before "=" or ":" (PGPASSWORD=..., REDIS_PASSWORD=
# '...', "password: ...", "X-Api-Key: ...", client_secret=...).
_TEXT_SECRET_KEY = r"[\w\-]*(?:password|passwd|pwd|secret|api[_\-]?key)[\w\-]*"
_KEY_VALUE = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>{_TEXT_SECRET_KEY})(?P<sep>\s*[=:]\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)"
)
# ?access_token=... &token=... ;api_key=...
_QUERY = re.compile(rf"(?i)(?P<head>[?&;][\w.\-]*(?:{_SECRET_NAME})[\w.\-]*=)[^&\s#\"']+")
_SCHEME_CREDENTIALS = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]+")
_API_TOKEN = re.compile(rf"{API_TOKEN_PREFIX}[A-Za-z0-9_\-]+")


def redact_text(text: str) -> str:
    """``text`` with every credential it holds replaced by :data:`REDACTED`."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    text = _KEY_VALUE.sub(lambda m: f"{m.group('key')}{m.group('sep')}{REDACTED}", text)
    text = _QUERY.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    text = _SCHEME_CREDENTIALS.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _API_TOKEN.sub(f"{API_TOKEN_PREFIX}{REDACTED}", text)


def redact(value: Any, key: str = "") -> Any:
    """Redact a log field: secret-named keys entirely, text and nested values recursively."""
    if key and _SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value
