"""What a log line must never carry, removed on the way out (docs/design.md, "Logs").

Fields whose name says secret (password, token, cookie, authorization, ...) are replaced
whole. In free text: the password part of any URL (everything between ``user:`` and the
last ``@`` of the word, so a password holding ``@``, ``:``, ``/`` or ``?`` is hidden
whole; a little more than the password may go with it, never less), the value after any
key that names a password and ``=`` or ``:`` (``password=...`` in key=value connection
strings, ``PGPASSWORD=...``, ``password: ...``, ``X-Api-Key: ...``, ``'password':
'...'`` and ``"password": "..."`` as a dict's repr or JSON print them), the value after
a key that ends in ``token``, ``cookie`` or an ``auth`` part directly before ``=``
(``token=...``, ``REDISCLI_AUTH=...``, ``FLOWER_BASIC_AUTH=user:pw``) or quoted before
``:`` (``"access_token": "..."``), an ``Authorization:`` header's credentials whatever
their scheme, a Redis ``AUTH`` command's arguments, secret-named query parameters
(``?access_token=...``), ``Bearer``/``Basic`` credentials and the API's own tokens
(``tdk_...``) wherever they appear.

Prose keeps its words: ``token`` or ``auth`` not written as a key (``a bearer token``,
``token: expired``, ``author=...``, ``token_type=...``, ``task_id=...``) and a lower-case
``auth`` (``auth failed``) are left alone.
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
# password=... in libpq-style "key=value" strings (quoted or not), and any key that names a
# password, alone or inside a longer name, bare or quoted, before "=" or ":" (PGPASSWORD=...,
# REDIS_PASSWORD='...', "password: ...", "X-Api-Key: ...", client_secret=..., {'password':
# '...'}, {"password": "..."}).
_TEXT_SECRET_KEY = r"[\w\-]*(?:password|passwd|pwd|secret|api[_\-]?key)[\w\-]*"
_KEY_VALUE = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>(?P<q>['\"]?){_TEXT_SECRET_KEY}(?P=q))(?P<sep>\s*[=:]\s*){_VALUE}"
)
# Keys that hold a credential only when written as a key: the name ends in "token" or
# "cookie" (access_token, csrftoken) or in an "auth" part (REDISCLI_AUTH, basic_auth, not
# author or oauth). Bare: only directly before "=" (an environment variable, a flag, a
# key=value pair); quoted (a dict's repr, JSON): before ":" or "=".
_CREDENTIAL_KEY = r"(?:[\w\-]*(?:token|cookie)|(?:[\w\-]*[_\-])?auth)"
_CREDENTIAL_ASSIGNED = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>{_CREDENTIAL_KEY})(?P<sep>=)(?!\[REDACTED\]){_VALUE}"
    rf"|(?<![\w\-])(?P<qkey>(?P<q>['\"]){_CREDENTIAL_KEY}(?P=q))(?P<qsep>\s*[=:]\s*){_VALUE}"
)
# An Authorization header's credentials, after its scheme when one is named (Token,
# Digest, ... as well as Bearer and Basic).
_AUTH_SCHEMES = r"bearer|basic|token|digest|negotiate|ntlm|apikey|key|bot|hoba|mutual"
_AUTHORIZATION = re.compile(
    rf"(?i)(?<![\w\-])(?P<head>(?:proxy-)?authorization\s*[:=]\s*(?:(?:{_AUTH_SCHEMES})\s+)?)"
    r"(?!\[REDACTED\])\S+"
)
# Redis's AUTH [user] password, as a command line (AUTH pw, AUTH user pw, HELLO 3 AUTH
# user pw) or a client's argument list ('AUTH', 'user', 'pw'): every argument goes. Upper
# case only, as commands are written; "auth failed" is prose.
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
