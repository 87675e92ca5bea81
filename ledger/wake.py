"""Waking the dispatcher: the NOTIFY channel every ledger change that concerns it uses.

A notification carries nothing (the ledger is the truth): it only says "look again".
Inserts notify through a statement-level trigger (migrations 0004 and 0010: only a
statement that inserted a row notifies, so a refused creation wakes nothing);
completions, failure reports, cancels and manual retries send :data:`WAKE_SQL` in their
own transaction, so the notification is delivered at commit and dropped by a rollback. Identical
notifications in one transaction coalesce into one.
"""

from __future__ import annotations

WAKE_CHANNEL = "teamdesk_dispatch"

WAKE_SQL = f"SELECT pg_notify('{WAKE_CHANNEL}', '')"
