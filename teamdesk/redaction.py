"""What a log line must never carry, removed on the way out (docs/design.md, "Logs").

A URL's password is cut up to the last ``@`` of the word: a little more may go, never
less. Prose keeps ``token`` and ``auth`` (``token: expired``, ``token_type=``, ``auth failed``).
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
# A value: quoted (backslash escapes included, as repr and JSON write them) or one word.
_VALUE = r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)"
# Any key naming a password or secret, inside a longer name too, bare or quoted, before
# "=" or ":" (PGPASSWORD=..., "X-Api-Key: ...", {'password': '...'}).
_TEXT_SECRET_KEY = r"[\w\-]*(?:password|passwd|pwd|secret|api[_\-]?key)[\w\-]*"
_KEY_VALUE = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>(?P<q>['\"]?){_TEXT_SECRET_KEY}(?P=q))(?P<sep>\s*[=:]\s*){_VALUE}"
)
# A name ending in "token", "cookie" or an "auth" part (REDISCLI_AUTH, not author or
# oauth): bare only directly before "="; quoted before ":" or "=".
_CREDENTIAL_KEY = r"(?:[\w\-]*(?:token|cookie)|(?:[\w\-]*[_\-])?auth)"
_CREDENTIAL_ASSIGNED = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>{_CREDENTIAL_KEY})(?P<sep>=)(?!\[REDACTED\]){_VALUE}"
    rf"|(?<![\w\-])(?P<qkey>(?P<q>['\"]){_CREDENTIAL_KEY}(?P=q))(?P<qsep>\s*[=:]\s*){_VALUE}"
)
# An Authorization header's credentials, after its scheme when one is named.
_AUTH_SCHEMES = r"bearer|basic|token|digest|negotiate|ntlm|apikey|key|bot|hoba|mutual"
_AUTHORIZATION = re.compile(
    rf"(?i)(?<![\w\-])(?P<head>(?:proxy-)?authorization\s*[:=]\s*(?:(?:{_AUTH_SCHEMES})\s+)?)"
    r"(?!\[REDACTED\])\S+"
)
# Redis's AUTH [user] password, as a command line or a client's argument list ('AUTH',
# 'user', 'pw'); upper case only, as commands are written.
_REDIS_AUTH = re.compile(
    r"(?<![\w\-])(?P<head>AUTH)(?:[ \t]+\S+){1,2}"
    r"|(?P<qhead>(?P<q>['\"])AUTH(?P=q))(?:\s*,\s*(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")){1,2}"
)
# ?access_token=... &token=... ;api_key=...
_QUERY = re.compile(rf"(?i)(?P<head>[?&;][\w.\-]*(?:{_SECRET_NAME})[\w.\-]*=)[^&\s#\"']+")
# Bearer and Basic credentials anywhere, but not the prose "a bearer token", "basic auth".
_SCHEME_CREDENTIALS = re.compile(
    r"(?i)\b(bearer|basic)\s+(?!(?:tokens?|auth\w*|credentials?)(?![\w.~+/=\-]))[\w.~+/=\-]+"
)
_API_TOKEN = re.compile(rf"{API_TOKEN_PREFIX}[A-Za-z0-9_\-]+")


def _keep_key(match: re.Match[str]) -> str:
    """The key and its separator as they were, the value redacted."""
    if match.group("key") is not None:
        return f"{match.group('key')}{match.group('sep')}{REDACTED}"
    return f"{match.group('qkey')}{match.group('qsep')}{REDACTED}"


def _keep_command(match: re.Match[str]) -> str:
    if match.group("head") is not None:
        return f"{match.group('head')} {REDACTED}"
    return f"{match.group('qhead')}, {REDACTED}"


def redact_text(text: str) -> str:
    """``text`` with every credential it holds replaced by :data:`REDACTED`."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    text = _KEY_VALUE.sub(lambda m: f"{m.group('key')}{m.group('sep')}{REDACTED}", text)
    text = _QUERY.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    text = _CREDENTIAL_ASSIGNED.sub(_keep_key, text)
    text = _AUTHORIZATION.sub(lambda m: f"{m.group('head')}{REDACTED}", text)
    text = _REDIS_AUTH.sub(_keep_command, text)
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
