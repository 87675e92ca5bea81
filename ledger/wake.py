"""Waking the dispatcher: the NOTIFY channel of every ledger change that concerns it
(docs/design.md, "Dispatch"). A notification carries nothing, only "look again". Inserts
notify by a statement trigger (migrations 0004, 0010) only when they inserted a row; other
changes send :data:`WAKE_SQL` in their own transaction (delivered at commit, dropped by a
rollback).
"""

from __future__ import annotations

WAKE_CHANNEL = "teamdesk_dispatch"

WAKE_SQL = f"SELECT pg_notify('{WAKE_CHANNEL}', '')"
