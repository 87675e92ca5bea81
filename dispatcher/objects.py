"""The dispatcher's purge of CSVs kept in an object store, one pass at a time on a thread of
its own, calling the store with no transaction open (docs/design.md, "Exports").

A pass deletes expired CSVs' objects, then the rows still naming them forget them (a failed
delete leaves the rows: the next pass tries again); then it sweeps one page of the store's
listing of objects no row names and open uploads, past the grace. It runs while rows name
objects, whatever ``EXPORT_STORE`` says now (going back to ``postgres`` keeps the AWS
settings until the last object expired). The bucket's lifecycle rule
(deploy/security.md, "Object store") is the second line.
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
    """One pass, in the caller's thread."""
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
