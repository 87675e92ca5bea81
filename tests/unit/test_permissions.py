"""The permission rules, as a table: one home, the same answer for API, CLI and worker."""

from __future__ import annotations

import uuid

import pytest

from ledger import permissions
from ledger.permissions import STAFF

OWNER, OTHER = uuid.uuid4(), uuid.uuid4()


@pytest.mark.parametrize(
    ("scope", "role", "allowed"),
    [
        ("MINE", STAFF, True),
        ("MINE", "CUSTOMER", True),
        ("TEAM", STAFF, True),
        ("TEAM", "CUSTOMER", False),
        ("TEAM", "CUSTOMER", False),
        ("MINE", None, False),
        ("TEAM", None, False),
    ],
)
def test_who_may_export(scope: str, role: str | None, allowed: bool) -> None:
    assert permissions.may_export(scope, role) is allowed


@pytest.mark.parametrize(
    ("scope", "role", "refusal"),
    [
        ("MINE", "CUSTOMER", None),
        ("TEAM", STAFF, None),
        ("MINE", None, permissions.MSG_CREATOR_LEFT),
        ("TEAM", None, permissions.MSG_CREATOR_LEFT),
        ("TEAM", "CUSTOMER", permissions.MSG_CREATOR_NOT_STAFF),
    ],
)
def test_why_an_existing_export_may_not_run(scope: str, role: str | None, refusal: str) -> None:
    assert permissions.export_refusal(scope, role) == refusal


def test_reminders_need_staff_to_schedule_and_membership_to_send() -> None:
    assert [permissions.may_schedule_reminder(r) for r in (STAFF, "CUSTOMER", None)] == [
        True,
        False,
        False,
    ]
    assert permissions.reminder_refusal("CUSTOMER") is None
    assert permissions.reminder_refusal(None) == permissions.MSG_CREATOR_LEFT


@pytest.mark.parametrize(
    ("scope", "owner", "role", "visible"),
    [
        ("MINE", OWNER, "CUSTOMER", True),
        ("MINE", OWNER, STAFF, True),
        ("MINE", OTHER, STAFF, False),
        ("TEAM", OTHER, STAFF, True),
        ("TEAM", OWNER, STAFF, True),
        ("TEAM", OTHER, "CUSTOMER", False),
        ("TEAM", OWNER, "CUSTOMER", False),  # created while staff, since demoted
        ("MINE", OWNER, None, False),
        ("TEAM", OWNER, None, False),
    ],
)
def test_who_sees_a_task(scope: str, owner: uuid.UUID, role: str | None, visible: bool) -> None:
    assert permissions.may_see(scope, owner, OWNER, role) is visible
