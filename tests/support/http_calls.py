"""Plain HTTP calls to an API served by a real process (urllib: no client library)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(
    base: str,
    method: str,
    path: str,
    token: str | None = None,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            raw = answer.read()
            status = answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
