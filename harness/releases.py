"""A previous release, checked out from this repository's own history and installed into a
virtualenv of its own, so a test can run its processes beside head's
(tests/process/test_upgrade.py; docs/decisions.md, "Expand and contract: the previous
release keeps working").

The release is named by commit in ``previous_release.txt`` beside this module: a fresh
CI clone may have no tags, but it has the history (the commit is an ancestor of head; a
shallow clone must fetch it). Its source comes out of ``git archive`` (the working tree,
its index and its worktree list are left alone) and its virtualenv is installed the way
the image installs head: ``pip install -c <its own constraints.txt> <its source>``. Both
are kept under ``$TEAMDESK_RELEASE_CACHE`` (default ``~/.cache/teamdesk-upgrade``) in a
directory named by the commit and the Python version, so only the first run installs;
a file lock makes a second test run wait for the first one's install instead of racing it.
"""

from __future__ import annotations

import fcntl
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.processes import ROOT, Proc

RELEASE_FILE = Path(__file__).with_name("previous_release.txt")
CACHE_ENV = "TEAMDESK_RELEASE_CACHE"
INSTALLED_MARK = "installed"  # written last: a directory without it is rebuilt
INSTALL_TIMEOUT_S = 900


class ReleaseUnavailable(RuntimeError):
    """The previous release's commit cannot be checked out or installed here."""


@dataclass(frozen=True)
class Release:
    """One release by commit, and where its source and virtualenv live once installed."""

    commit: str
    label: str

    @property
    def home(self) -> Path:
        version = f"py{sys.version_info.major}.{sys.version_info.minor}"
        return cache_root() / f"{self.commit}-{version}"

    @property
    def src(self) -> Path:
        """The release's source tree: the working directory of its processes."""
        return self.home / "src"

    @property
    def python(self) -> Path:
        return self.home / "venv" / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.home / "venv" / "bin" / name

    @property
    def installed(self) -> bool:
        return (self.home / INSTALLED_MARK).exists()


def cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "teamdesk-upgrade"
    return Path(os.environ.get(CACHE_ENV, default))


def previous_release() -> Release:
    """The release named in ``previous_release.txt`` (``<commit> <label>``; ``#`` comments)."""
    for line in RELEASE_FILE.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            return Release(fields[0], fields[1] if len(fields) > 1 else fields[0][:7])
    raise ReleaseUnavailable(f"{RELEASE_FILE} names no commit")


def ensure_installed(release: Release) -> float | None:
    """Check out and install ``release`` unless its cached copy is complete; returns the
    seconds the install took, None when the cache had it."""
    release.home.parent.mkdir(parents=True, exist_ok=True)
    with (release.home.parent / f"{release.home.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if release.installed:
            return None
        started = time.monotonic()
        shutil.rmtree(release.home, ignore_errors=True)  # an interrupted install's leftovers
        _check_out(release)
        _install(release)
        (release.home / INSTALLED_MARK).write_text(f"{release.commit} {release.label}\n")
        return time.monotonic() - started


def _check_out(release: Release) -> None:
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{release.commit}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode != 0:
        raise ReleaseUnavailable(
            f"commit {release.commit} ({release.label}) is not in this clone's history;"
            " a shallow clone needs `git fetch --unshallow` (CI: fetch-depth 0)"
        )
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", release.commit],
        capture_output=True,
        check=True,
    )
    release.src.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(release.src, filter="data")


def _install(release: Release) -> None:
    steps = [
        [sys.executable, "-m", "venv", str(release.home / "venv")],
        [
            str(release.python),
            *("-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            *("-c", str(release.src / "constraints.txt"), str(release.src)),
        ],
    ]
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            raise ReleaseUnavailable(
                f"installing {release.label} failed: {' '.join(argv)}\n{done.stderr[-3000:]}"
            )


def release_env(release: Release, env: dict[str, str]) -> dict[str, str]:
    """``env`` (harness.processes.settings_env's) for the release's processes: its own
    virtualenv first on PATH, nothing that would import head's code."""
    own = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    own["PATH"] = f"{release.home / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
    own["VIRTUAL_ENV"] = str(release.home / "venv")
    return own


def release_argv(release: Release, head_argv: list[str]) -> list[str]:
    """A ``python -m ...`` command line of head's helpers (``worker_argv``, ``celery_argv``)
    run by the release's Python instead."""
    assert head_argv[0] == sys.executable, head_argv
    return [str(release.python), *head_argv[1:]]


class ReleaseProc(Proc):
    """A :class:`harness.processes.Proc` of the release: its Python, its source as the
    working directory (``python -m celery -A tasks`` imports the release's ``tasks``)."""

    def __init__(
        self, release: Release, name: str, argv: list[str], env: dict[str, str], log_dir: Path
    ) -> None:
        super().__init__(name, release_argv(release, argv), release_env(release, env), log_dir)
        self.release = release

    def start(self) -> ReleaseProc:
        out = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.release.src,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        return self
