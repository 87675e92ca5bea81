"""The ledger and business tables as SQLAlchemy Core metadata (docs/design.md, "Ledger").

The schema is created by the Alembic revisions in ``ledger/migrations``; this module
describes the same schema so that a test can prove the two never drift apart.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from ledger.states import KINDS, SCOPES, STATUSES

TICKET_STATUSES = ("OPEN", "PENDING", "RESOLVED", "CLOSED")
TICKET_PRIORITIES = ("LOW", "NORMAL", "HIGH", "URGENT")
MEMBERSHIP_ROLES = ("STAFF", "CUSTOMER")

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _id() -> sa.Column[object]:
    return sa.Column(
        "id", UUID(as_uuid=True), primary_key=True, server_default=sa.text("gen_random_uuid()")
    )


def _created_at() -> sa.Column[object]:
    return sa.Column(
        "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    )


def _fk(
    name: str, target: str, nullable: bool = False, ondelete: str | None = None
) -> sa.Column[object]:
    return sa.Column(
        name, UUID(as_uuid=True), sa.ForeignKey(target, ondelete=ondelete), nullable=nullable
    )


teams = sa.Table(
    "teams", metadata, _id(), sa.Column("name", sa.Text, nullable=False), _created_at()
)

users = sa.Table(
    "users",
    metadata,
    _id(),
    sa.Column("email", sa.Text, nullable=False, unique=True),
    sa.Column("name", sa.Text, nullable=False),
    _created_at(),
)

memberships = sa.Table(
    "memberships",
    metadata,
    sa.Column("team_id", UUID(as_uuid=True), sa.ForeignKey("teams.id"), primary_key=True),
    sa.Column("user_id", UUID(as_uuid=True), sa.ForeignKey("users.id"), primary_key=True),
    sa.Column("role", sa.Text, nullable=False),
    _created_at(),
    sa.CheckConstraint(_in("role", MEMBERSHIP_ROLES), name="role"),
)
sa.Index("ix_memberships_user_id", memberships.c.user_id)

tickets = sa.Table(
    "tickets",
    metadata,
    _id(),
    _fk("team_id", "teams.id"),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="OPEN"),
    sa.Column("priority", sa.Text, nullable=False, server_default="NORMAL"),
    _fk("requester_id", "users.id"),
    _fk("assignee_id", "users.id", nullable=True),
    sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("version", sa.Integer, nullable=False, server_default="0"),
    _created_at(),
    sa.Column(
        "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.CheckConstraint(_in("status", TICKET_STATUSES), name="status"),
    sa.CheckConstraint(_in("priority", TICKET_PRIORITIES), name="priority"),
    sa.CheckConstraint("version >= 0", name="version"),
)
# The export reads a team's tickets in (created_at, id) keyset order.
sa.Index("ix_tickets_team_created", tickets.c.team_id, tickets.c.created_at, tickets.c.id)

background_tasks = sa.Table(
    "background_tasks",
    metadata,
    _id(),
    sa.Column("kind", sa.Text, nullable=False),
    _fk("team_id", "teams.id"),
    _fk("owner_id", "users.id"),
    sa.Column("scope", sa.Text, nullable=False),
    sa.Column("filters", JSONB, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="WAITING"),
    sa.Column("run", sa.Integer, nullable=False, server_default="0"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("progress", sa.Integer, nullable=False, server_default="0"),
    sa.Column("execution_id", UUID(as_uuid=True), nullable=True),
    sa.Column("lease_holder", sa.Text, nullable=True),
    sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("run_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    # WAITING, unpublished and run_at still ahead (database clock): kept by the row trigger
    # background_tasks_scheduled, cleared by the dispatcher's promotion when due (0008).
    sa.Column("scheduled", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("recoveries", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("result_csv", sa.Text, nullable=True),
    sa.Column("result_summary", sa.Text, nullable=True),
    # An export's stored CSV in bytes (the daily export quota sums it; migration 0009).
    sa.Column("result_bytes", sa.BigInteger, nullable=True),
    # When the current run was opened: its creation or the retry that opened it (the daily
    # export quota counts by it; migration 0012). NULL only on rows older than 0012.
    sa.Column(
        "run_opened_at", sa.DateTime(timezone=True), nullable=True, server_default=sa.func.now()
    ),
    # The execution whose chunks (export_chunks) are the CSV, and their SHA-256 (0013).
    sa.Column("result_key", UUID(as_uuid=True), nullable=True),
    sa.Column("result_sha256", sa.Text, nullable=True),
    # Where the CSV is when EXPORT_STORE is an object store (s3://BUCKET/KEY; 0015); NULL:
    # in export_chunks.
    sa.Column("result_object", sa.Text, nullable=True),
    # The W3C traceparent of the span that created the task or opened its run (0017,
    # teamdesk/tracing.py); NULL when tracing is off.
    sa.Column("trace_parent", sa.Text, nullable=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    _created_at(),
    sa.Column(
        "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.CheckConstraint(_in("kind", KINDS), name="kind"),
    sa.CheckConstraint(_in("scope", SCOPES), name="scope"),
    sa.CheckConstraint(_in("status", STATUSES), name="status"),
    sa.CheckConstraint("progress BETWEEN 0 AND 100", name="progress"),
    sa.CheckConstraint("run >= 0 AND attempts >= 0 AND recoveries >= 0", name="counters"),
    sa.CheckConstraint("kind = 'EXPORT' OR scope = 'TEAM'", name="reminder_scope"),
    sa.CheckConstraint("status = 'RUNNING' OR execution_id IS NULL", name="lease_only_running"),
    sa.CheckConstraint(
        "NOT scheduled OR (status = 'WAITING' AND dispatched_at IS NULL)", name="scheduled_waiting"
    ),
)
# Scheduled runs by due time: the dispatcher's promotion and its next wake-up (0008).
sa.Index(
    "ix_background_tasks_scheduled",
    background_tasks.c.run_at,
    postgresql_where=sa.text("scheduled"),
)
# WAITING, unpublished: the round-robin walks scheduled = false; the quota counts both.
sa.Index(
    "ix_background_tasks_ready",
    background_tasks.c.kind,
    background_tasks.c.scheduled,
    background_tasks.c.team_id,
    background_tasks.c.run_at,
    background_tasks.c.id,
    postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NULL"),
)
# In flight (running, or published and not yet claimed): per team and per queue.
sa.Index(
    "ix_background_tasks_inflight",
    background_tasks.c.team_id,
    background_tasks.c.kind,
    postgresql_where=sa.text(
        "status = 'RUNNING' OR (status = 'WAITING' AND dispatched_at IS NOT NULL)"
    ),
)
# Dispatcher step 4: WAITING rows already published, by publish (or retry-due) time.
sa.Index(
    "ix_background_tasks_dispatched",
    background_tasks.c.dispatched_at,
    postgresql_where=sa.text("status = 'WAITING' AND dispatched_at IS NOT NULL"),
)
# Dispatcher step 1: RUNNING rows by staleness.
sa.Index(
    "ix_background_tasks_running",
    background_tasks.c.updated_at,
    postgresql_where=sa.text("status = 'RUNNING'"),
)
# Dispatcher step 5: CSVs still held, by expiry.
sa.Index(
    "ix_background_tasks_expiring",
    background_tasks.c.expires_at,
    postgresql_where=sa.text("result_csv IS NOT NULL"),
)
# Retention: finished rows by when they finished (ledger/retention.py).
sa.Index(
    "ix_background_tasks_finished",
    background_tasks.c.updated_at,
    # PostgreSQL stores IN (...) as = ANY (ARRAY[...]); written that way, model and
    # database compare equal (tests/integration/test_schema.py).
    postgresql_where=sa.text("status = ANY (ARRAY['COMPLETED', 'FAILED', 'CANCELLED'])"),
)
# The previous release's daily export quota: exports by creation time (0009; 0012 keeps
# it for that release).
sa.Index(
    "ix_background_tasks_team_exports",
    background_tasks.c.team_id,
    background_tasks.c.created_at,
    postgresql_where=sa.text("kind = 'EXPORT'"),
)
# The daily export quota: a team's exports by when their current run opened (0012).
sa.Index(
    "ix_background_tasks_team_export_runs",
    background_tasks.c.team_id,
    background_tasks.c.run_opened_at,
    postgresql_where=sa.text("kind = 'EXPORT'"),
)
# Dispatcher step 5: CSVs held as chunks, by expiry (0013).
sa.Index(
    "ix_background_tasks_results_expiring",
    background_tasks.c.expires_at,
    postgresql_where=sa.text("result_key IS NOT NULL"),
)
# Dispatcher step 5: CSVs held as objects, by expiry (0015).
sa.Index(
    "ix_background_tasks_objects_expiring",
    background_tasks.c.expires_at,
    postgresql_where=sa.text("result_object IS NOT NULL"),
)
# API: a team's task list, newest first.
sa.Index(
    "ix_background_tasks_team_created", background_tasks.c.team_id, background_tasks.c.created_at
)

# An export's CSV in bounded pieces, keyed by the execution that wrote them (0013,
# ledger/artifacts.py); only the execution a completion names (result_key) is served.
export_chunks = sa.Table(
    "export_chunks",
    metadata,
    _fk("task_id", "background_tasks.id", ondelete="CASCADE"),
    sa.Column("execution_id", UUID(as_uuid=True), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    _created_at(),
    sa.PrimaryKeyConstraint("task_id", "execution_id", "seq"),
    sa.CheckConstraint("seq >= 0", name="seq"),
)
# Retention: each execution's first chunk by age, for orphans (ledger/artifacts.py).
sa.Index(
    "ix_export_chunks_created_at",
    export_chunks.c.created_at,
    postgresql_where=sa.text("seq = 0"),
)

notifications = sa.Table(
    "notifications",
    metadata,
    _id(),
    _fk("user_id", "users.id"),
    _fk("ticket_id", "tickets.id"),
    # NULL once the task that sent it is past its retention (ledger/retention.py).
    _fk("task_id", "background_tasks.id", nullable=True, ondelete="SET NULL"),
    sa.Column("kind", sa.Text, nullable=False, server_default="TICKET_REMINDER"),
    _created_at(),
    sa.UniqueConstraint("task_id", "user_id", name="uq_notifications_task_user"),
)

system_events = sa.Table(
    "system_events",
    metadata,
    _id(),
    _fk("team_id", "teams.id"),
    _fk("ticket_id", "tickets.id", nullable=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    _created_at(),
)
sa.Index("ix_system_events_ticket_id", system_events.c.ticket_id)

AUDIT_EVENTS = ("CLAIM", "COMPLETE", "WAIT", "FAIL", "RECOVER", "RECONCILE", "CANCEL", "RETRY")

# Append-only trail of every change of a lease or run, written by the change's own
# statement: an auditor can prove each completion was made by the lease's holder.
task_audit = sa.Table(
    "task_audit",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    _fk("task_id", "background_tasks.id"),
    sa.Column("run", sa.Integer, nullable=False),
    sa.Column("event", sa.Text, nullable=False),
    sa.Column("execution_id", UUID(as_uuid=True), nullable=True),
    sa.Column(
        "at",
        sa.DateTime(timezone=True),
        nullable=False,
        server_default=sa.text("clock_timestamp()"),
    ),
    sa.CheckConstraint(_in("event", AUDIT_EVENTS), name="event"),
)
sa.Index("ix_task_audit_task_id", task_audit.c.task_id, task_audit.c.id)

# Bearer tokens, stored as hashes (ledger/tokens.py; docs/design.md, "Ledger").
api_tokens = sa.Table(
    "api_tokens",
    metadata,
    _id(),
    sa.Column("token_hash", sa.Text, nullable=False, unique=True),
    _fk("user_id", "users.id"),
    sa.Column("name", sa.Text, nullable=True),
    _created_at(),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
)
# `token list EMAIL` and demo-seed's revocation read a user's tokens.
sa.Index("ix_api_tokens_user_id", api_tokens.c.user_id)

# Idempotency keys (0016, ledger/idempotency.py; docs/design.md, "Idempotent requests").
idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("team_id", UUID(as_uuid=True), nullable=False),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("user_id", UUID(as_uuid=True), nullable=False),
    sa.Column("fingerprint", sa.LargeBinary, nullable=False),
    sa.Column("task_id", UUID(as_uuid=True), nullable=False),
    sa.Column("run", sa.Integer, nullable=False),
    _created_at(),
    sa.PrimaryKeyConstraint("team_id", "key"),
)
# The dispatcher's purge: the expired keys, oldest first.
sa.Index("ix_idempotency_keys_created_at", idempotency_keys.c.created_at)
