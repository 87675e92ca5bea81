"""``make run``'s Flower password (cli/localrun.py): FLOWER_PASSWORD when set, else one made
once per checkout and kept in its git-ignored local state (``.localrun/flower_password``,
0600), so a bookmark or a saved login still works after the next ``make run``. The
options are built exactly as ``run-local`` builds them (:func:`cli.localrun.options_from`),
with the state directory pointed at a temporary one."""

from __future__ import annotations

import argparse
import stat
import subprocess
from pathlib import Path

import pytest

from cli import localrun

ROOT = Path(__file__).resolve().parents[2]


def run_local_args() -> argparse.Namespace:
    """``teamdesk-tasks run-local`` with no flag (what ``make run`` passes)."""
    return argparse.Namespace(
        api_port=None, flower_port=None, procfile=None, tickets=3000, slow_exports=None
    )


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout's local state directory (not made yet), and no FLOWER_PASSWORD."""
    state = tmp_path / "checkout" / ".localrun"
    monkeypatch.setattr(localrun, "STATE_DIR", state)
    monkeypatch.delenv("FLOWER_PASSWORD", raising=False)
    return state


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_two_runs_in_one_checkout_get_the_same_password_kept_0600(checkout: Path) -> None:
    first = localrun.options_from(run_local_args())
    second = localrun.options_from(run_local_args())
    assert first.flower_password == second.flower_password
    assert len(first.flower_password) >= 16 and not first.password_from_env
    kept = checkout / "flower_password"
    assert first.password_file == kept
    assert kept.read_text().strip() == first.flower_password
    assert mode(kept) == 0o600
    assert mode(checkout) == 0o700
    assert [p.name for p in checkout.iterdir()] == ["flower_password"]  # nothing left aside


def test_another_checkout_gets_another_password(
    checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = localrun.options_from(run_local_args()).flower_password
    monkeypatch.setattr(localrun, "STATE_DIR", tmp_path / "other" / ".localrun")
    assert localrun.options_from(run_local_args()).flower_password != mine


def test_flower_password_wins_and_writes_nothing(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWER_PASSWORD", "chosen-by-me")
    options = localrun.options_from(run_local_args())
    assert (options.flower_password, options.password_from_env) == ("chosen-by-me", True)
    assert options.password_file is None
    assert not checkout.exists()


def test_flower_password_wins_over_a_kept_one(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = localrun.options_from(run_local_args()).flower_password
    monkeypatch.setenv("FLOWER_PASSWORD", "chosen-by-me")
    assert localrun.options_from(run_local_args()).flower_password == "chosen-by-me"
    monkeypatch.delenv("FLOWER_PASSWORD")
    assert localrun.options_from(run_local_args()).flower_password == kept  # still kept


def test_a_kept_password_others_can_read_is_made_0600(checkout: Path) -> None:
    checkout.mkdir(parents=True)
    (checkout / "flower_password").write_text("mine-from-before\n")
    (checkout / "flower_password").chmod(0o644)
    assert localrun.options_from(run_local_args()).flower_password == "mine-from-before"
    assert mode(checkout / "flower_password") == 0o600


def test_a_state_directory_that_cannot_be_written_says_what_to_do(checkout: Path) -> None:
    checkout.parent.mkdir(parents=True)
    checkout.write_text("a file where the directory should be")
    with pytest.raises(localrun.RunError, match="set FLOWER_PASSWORD to choose one"):
        localrun.options_from(run_local_args())


def test_the_kept_password_is_in_the_checkout_and_git_ignored() -> None:
    assert localrun.STATE_DIR.parent == ROOT
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    kept = localrun.STATE_DIR / "flower_password"
    ignored = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", str(kept)], check=False, timeout=30
    )
    assert ignored.returncode == 0, f"{kept.relative_to(ROOT)} is not git-ignored"
