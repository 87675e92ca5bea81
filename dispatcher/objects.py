"""The dispatcher's purge of CSVs kept in an object store (EXPORT_STORE=s3://...;
docs/design.md, "Exports": "Where a CSV is kept").

Each purge (every ``PURGE_INTERVAL_S``) starts one pass on a thread of its own
(``Cluster.object_purges``; a pass still under way skips the turn), so a slow or silent
store never holds a scan; and it calls the store with no database transaction open, so
it never holds a row lock:

1. **Expired CSVs.** Up to a page of rows naming an object past its 24 hours are read;
   their objects are deleted from the store; then the rows forget them - only those
   still naming the same object (one guarded statement). A failed delete leaves the rows
   as they were: the next pass tries again.
2. **Orphans.** The next page of the store's listing (a cursor walks the exports folder a
   page per pass and starts over at its end): an object no row names - an execution
   that uploaded and then lost its lease, crashed, or was refused - is deleted once it is
   older than the grace. So is a multipart upload left open by a crash.

It runs whatever ``EXPORT_STORE`` says now, as long as rows name objects (an operator who
went back to ``postgres`` keeps the AWS settings until the last object expired). Ages are
judged by the database's clock (the store's timestamps are compared with ``now()`` in SQL,
ledger/artifacts.py). The grace, an hour past ``EXPORT_READ_BUDGET_S``, is longer than any
execution's upload. A failing store is logged (``dispatcher.store_failed``); nothing is
lost. The bucket's lifecycle rule (deploy/README.md, "Object store") is the second line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dispatcher.context import Cluster, transaction
from ledger import artifacts
from teamdesk import export_store, s3_store
from teamdesk.export_store import ObjectStoreError, StoreTarget
from teamdesk.logs import log_event

PAGE = 500  # rows or keys one pass looks at, per kind
GRACE_S = 3600.0  # beyond EXPORT_READ_BUDGET_S: an execution's upload never takes longer

log = logging.getLogger("teamdesk.dispatcher.objects")


@dataclass
class ObjectPurge:
    expired: int = 0  # expired CSVs' objects deleted
    orphans: int = 0  # objects no row names, and open uploads, removed
    error: str | None = None  # the store's failure, if one stopped this pass


def purge_objects(cluster: Cluster) -> ObjectPurge:
    """One pass, steps 1 and 2 above, in the caller's thread."""
    done = ObjectPurge()
    target = export_store.parse_store(cluster.settings.export_store)
    try:
        with transaction(cluster.engine) as conn:
            expired = artifacts.expired_objects(conn, PAGE)
        if target is None and not expired:
            return done  # no object store configured, and no object left to expire
        store = s3_store.object_store()
        if expired:
            store.delete(list(expired.values()))
            with transaction(cluster.engine) as conn:
                done.expired = artifacts.forget_objects(conn, expired)
        if target is not None:
            done.orphans = _sweep(cluster, store, target)
    except ObjectStoreError as exc:
        done.error = str(exc)
        log_event(log, "dispatcher.store_failed", logging.WARNING, error=str(exc))
    if done.expired or done.orphans:
        log_event(log, "dispatcher.objects_purged", expired=done.expired, orphans=done.orphans)
    return done


def _sweep(cluster: Cluster, store: s3_store.S3Store, target: StoreTarget) -> int:
    grace_s = GRACE_S + cluster.settings.export_read_budget_s
    found, cluster.object_sweep_after = store.list_exports(target, cluster.object_sweep_after, PAGE)
    uploads = store.open_uploads(target, PAGE)
    with transaction(cluster.engine) as conn:
        orphans = artifacts.unnamed_objects(conn, found, grace_s)
        stale = artifacts.stale_uploads(conn, uploads, grace_s)
    store.delete(orphans)
    for upload in stale:
        store.abort_upload(upload)
    return len(orphans) + len(stale)


def purge_objects_quietly(cluster: Cluster) -> None:
    """:func:`purge_objects` for the purger's thread (dispatcher/context.py,
    ``Cluster.object_purges``): a database error (the store's are handled inside) is
    logged as the scans' are, and the next purge tries again."""
    try:
        purge_objects(cluster)
    except Exception as exc:
        log_event(
            log,
            "dispatcher.failed",
            logging.WARNING,
            service="PostgreSQL",
            error=type(exc).__name__,
            reason="the object store's purge could not read or write the ledger",
        )
