"""The dispatcher's purge step for CSVs kept in an object store (EXPORT_STORE=s3://...;
docs/design.md, "Exports": "Where a CSV is kept").

Each purge (every ``PURGE_INTERVAL_S``, with the chunks' purge, ledger/dispatch.py):

1. **Expired CSVs.** Up to a batch of rows whose CSV is past its 24 hours are locked, their
   objects deleted, and the rows forget them, in one transaction: a row names its object
   until the object is gone (a failed delete is tried again at the next purge).
2. **Orphans.** The next page of the store's listing (a cursor walks the exports folder a
   page per purge and starts over at its end): an object no row names - an execution
   that uploaded and then lost its lease, crashed, or was refused - is deleted once it is
   older than the grace. So is a multipart upload left open by a crash.

Ages are judged by the database's clock (the store's timestamps are compared with
``now()`` in SQL, ledger/artifacts.py). The grace, an hour past ``EXPORT_READ_BUDGET_S``,
is longer than any execution's upload. A store that fails (unreachable, refusing) is
logged and the scan goes on: nothing is lost, the next purge tries again. The bucket's
lifecycle rule (deploy/README.md, "Object store") is the second line of defence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dispatcher.context import Cluster, transaction
from ledger import artifacts
from teamdesk import export_store, s3_store
from teamdesk.export_store import ObjectStoreError
from teamdesk.logs import log_event

PAGE = 500  # rows or keys one purge looks at, per kind
GRACE_S = 3600.0  # beyond EXPORT_READ_BUDGET_S: an execution's upload never takes longer

log = logging.getLogger("teamdesk.dispatcher.objects")


@dataclass
class ObjectPurge:
    expired: int = 0  # expired CSVs' objects deleted
    orphans: int = 0  # objects no row names, and open uploads, removed
    error: str | None = None  # the store's failure, if one stopped this purge


def purge_objects(cluster: Cluster) -> ObjectPurge:
    """Steps 1 and 2 above; nothing when the CSVs are kept in PostgreSQL."""
    done = ObjectPurge()
    target = export_store.parse_store(cluster.settings.export_store)
    if target is None:
        return done
    store = s3_store.object_store()
    grace_s = GRACE_S + cluster.settings.export_read_budget_s
    try:
        with transaction(cluster.engine) as conn:
            expired = artifacts.expired_objects(conn, PAGE)
            if expired:
                store.delete(list(expired.values()))
                artifacts.forget_objects(conn, list(expired))
        done.expired = len(expired)
        found, cluster.object_sweep_after = store.list_exports(
            target, cluster.object_sweep_after, PAGE
        )
        uploads = store.open_uploads(target, PAGE)
        with transaction(cluster.engine) as conn:
            orphans = artifacts.unnamed_objects(conn, found, grace_s)
            stale = artifacts.stale_uploads(conn, uploads, grace_s)
        store.delete(orphans)
        for upload in stale:
            store.abort_upload(upload)
        done.orphans = len(orphans) + len(stale)
    except ObjectStoreError as exc:
        done.error = str(exc)
        log_event(log, "dispatcher.store_failed", logging.WARNING, error=str(exc))
    return done
