"""The running version (teamdesk/version.py) and ``teamdesk-tasks --version``.

The installed package's metadata says it; without metadata (a source tree that was never
installed) the tree's pyproject.toml does; without either it is ``unknown``. The uninstalled
cases run a copy of the module in a subprocess with ``python -S`` (no site-packages, so no
installed metadata at all), not only with the metadata lookup patched out."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from cli.main import main
from teamdesk import version as version_module
from teamdesk.version import DISTRIBUTION, SOURCE_PYPROJECT, UNKNOWN, source_version, version
from tests.support.cli_runner import CLI

ROOT = Path(__file__).resolve().parents[2]
SEMANTIC = re.compile(r"\d+\.\d+\.\d+")
SUBPROCESS_TIMEOUT_S = 60


def pyproject_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture
def fresh_version() -> Iterator[None]:
    """version() reads once per process: forget that reading around a test that changes
    what it would read."""
    version.cache_clear()
    yield
    version.cache_clear()


def _no_metadata(name: str) -> str:
    raise metadata.PackageNotFoundError(name)


# -- teamdesk.version --------------------------------------------------------------------


def test_the_running_version_is_pyprojects_and_semantic() -> None:
    """The installed metadata agrees with pyproject.toml (a stale install says otherwise:
    `make install` reinstalls when pyproject.toml changes)."""
    assert SEMANTIC.fullmatch(pyproject_version())
    assert version() == metadata.version(DISTRIBUTION) == pyproject_version()
    assert SOURCE_PYPROJECT == ROOT / "pyproject.toml"


def test_without_package_metadata_the_source_trees_pyproject_says_it(
    fresh_version: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metadata, "version", _no_metadata)
    assert version() == pyproject_version()


def test_without_metadata_or_pyproject_the_version_is_unknown(
    fresh_version: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(metadata, "version", _no_metadata)
    monkeypatch.setattr(version_module, "SOURCE_PYPROJECT", tmp_path / "pyproject.toml")
    assert version() == UNKNOWN == "unknown"


@pytest.mark.parametrize(
    "text",
    [
        '[project]\nname = "someone-else"\nversion = "9.9.9"\n',  # another project's
        '[project]\nname = "teamdesk-tasks"\ndynamic = ["version"]\n',  # no static version
        '[project]\nname = "teamdesk-tasks"\nversion = ""\n',
        '[project]\nname = "teamdesk-tasks"\nversion = 1\n',
        'project = "teamdesk-tasks"\n',
        "[project\nname = ",  # not TOML
        "",
    ],
)
def test_a_pyproject_that_does_not_say_our_version_gives_unknown(tmp_path: Path, text: str) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text)
    assert source_version(pyproject) == UNKNOWN


def test_unreadable_pyprojects_give_unknown(tmp_path: Path) -> None:
    assert source_version(tmp_path / "missing.toml") == UNKNOWN
    assert source_version(tmp_path) == UNKNOWN  # a directory
    binary = tmp_path / "pyproject.toml"
    binary.write_bytes(b"\xff\xfe[project]")
    assert source_version(binary) == UNKNOWN


def _uninstalled_copy(tree: Path, *, with_pyproject: bool) -> str:
    """What ``version()`` says in a copy of the module run without site-packages."""
    (tree / "teamdesk").mkdir()
    (tree / "teamdesk" / "__init__.py").write_text("")
    shutil.copy(ROOT / "teamdesk" / "version.py", tree / "teamdesk" / "version.py")
    if with_pyproject:
        shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    code = (
        "import sys\n"
        "from importlib import metadata\n"
        f"try:\n    metadata.version({DISTRIBUTION!r})\n"
        "except metadata.PackageNotFoundError:\n    pass\n"
        "else:\n    sys.exit('the package metadata is visible: not an uninstalled tree')\n"
        "from teamdesk.version import version\n"
        "print(version())\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_uninstalled_source_tree_reports_its_pyprojects_version(tmp_path: Path) -> None:
    assert _uninstalled_copy(tmp_path, with_pyproject=True) == pyproject_version()


def test_an_uninstalled_copy_without_pyproject_reports_unknown(tmp_path: Path) -> None:
    assert _uninstalled_copy(tmp_path, with_pyproject=False) == "unknown"


# -- teamdesk-tasks --version ------------------------------------------------------------


def test_version_option_prints_the_name_and_version_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"teamdesk-tasks {pyproject_version()}\n", "")


def test_the_top_level_help_lists_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: teamdesk-tasks [-h] [--version] COMMAND ...")
    assert "--version" in out and "print the version" in out


def test_the_console_script_prints_the_version_without_reading_configuration() -> None:
    """``--version`` answers before the configuration is read: a bad value (which stops
    every command with exit 2) does not matter, and no service is contacted."""
    done = subprocess.run(
        [CLI, "--version"],
        env={"PATH": "/usr/bin:/bin", "LOG_LEVEL": "loud", "DATABASE_URL": "nonsense"},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"teamdesk-tasks {pyproject_version()}\n",
        "",
    )


def test_only_the_version_option_reads_the_package_metadata() -> None:
    """Parsing stays light (cli/main.py): other commands never import importlib.metadata
    for the version, and ``--version`` loads no Celery."""
    code = (
        "import sys\n"
        "from cli.main import build_parser, main\n"
        "build_parser().parse_args(['scan'])\n"
        "before = 'importlib.metadata' in sys.modules\n"
        "try:\n    main(['--version'])\n"
        "except SystemExit:\n    pass\n"
        "print(before, 'importlib.metadata' in sys.modules, 'celery' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False True False"
