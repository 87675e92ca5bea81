"""Headless Chromium for browser tests: render a page's DOM, take a screenshot.

Debian's ``chromium`` (installed by ``scripts/ensure_chromium.sh`` when missing) runs as
a one-shot command per page: ``--dump-dom URL`` prints the DOM after the page loaded
(its scripts included), ``--screenshot=PATH URL`` writes a PNG. Every run gets a fresh
``--user-data-dir`` (no cache, no cookies, no remembered credentials between runs) and the
flags this machine needs (``--no-sandbox`` as root, no background networking: the
network is closed and Chromium would otherwise keep trying Google's hosts).

Basic auth: Chromium accepts credentials in a top-level navigation URL
(``http://user:pass@127.0.0.1:PORT/...``). The first request goes out without them,
the server answers 401 with ``WWW-Authenticate: Basic``, and Chromium answers the
challenge from the URL's userinfo instead of prompting (headless has no prompt). It
blocks credentials only in sub-resource URLs, and Flower's ``/static`` files need none.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
from contextlib import suppress
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[2]
ENSURE_SCRIPT = ROOT / "scripts" / "ensure_chromium.sh"
CHROMIUM_ENV = "CHROMIUM"

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)
RUN_TIMEOUT_S = 60.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


SKIP_ENV = "TEAMDESK_SKIP_BROWSER"


def skip_reason(env: dict[str, str] | None = None) -> str | None:
    """Why the browser test is skipped, or None: only ``TEAMDESK_SKIP_BROWSER=1`` skips
    it (chosen by a person; CI leaves it unset, so the test runs there by default)."""
    value = (os.environ if env is None else env).get(SKIP_ENV, "")
    if value != "1":
        return None
    return (
        f"{SKIP_ENV}=1: Chromium not used, Flower's task page not rendered "
        "(tests/process/test_flower_cancelled.py still checks what Flower's API shows)"
    )


class BrowserUnavailable(RuntimeError):
    """Chromium is not installed and could not be installed."""


def find_chromium(install: bool = True) -> str:
    """Path of the Chromium binary ($CHROMIUM or ``chromium`` on PATH).

    When it is missing and ``install`` is true, runs ``scripts/ensure_chromium.sh``
    (apt-get, idempotent) once and looks again.
    """
    wanted = os.environ.get(CHROMIUM_ENV) or "chromium"
    found = shutil.which(wanted)
    if found is None and install:
        result = subprocess.run(
            ["bash", str(ENSURE_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if result.returncode != 0:
            raise BrowserUnavailable(
                f"{ENSURE_SCRIPT.name} could not install Chromium "
                f"(exit {result.returncode}):\n{result.stderr[-2000:]}"
            )
        found = shutil.which(wanted)
    if found is None:
        raise BrowserUnavailable(f"no Chromium: {wanted!r} is not on PATH")
    return found


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password@`` in its authority (percent-encoded)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """The URL with its password replaced, for messages."""
    return re.sub(r"//([^:/@]+):[^@/]*@", r"//\1:[REDACTED]@", url)


class Chromium:
    """One-shot headless Chromium runs; profiles and logs go under ``work_dir``."""

    def __init__(self, work_dir: Path, binary: str | None = None) -> None:
        self.binary = binary or find_chromium()
        self.work_dir = work_dir
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.runs = 0

    def version(self) -> str:
        result = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
        return result.stdout.strip()

    def dump_dom(self, url: str, window: tuple[int, int] = (1280, 900), settle_ms: int = 0) -> str:
        """The page's DOM after load, as HTML text; ``settle_ms`` lets the page's scripts
        run that long (virtual time) first (a page that renders what it fetches)."""
        settle = [f"--virtual-time-budget={settle_ms}"] if settle_ms else []
        return self._run([*settle, "--dump-dom", url], url, window)

    def screenshot(
        self, url: str, path: Path, window: tuple[int, int] = (1280, 900), settle_ms: int = 0
    ) -> Path:
        """A PNG of the page's first ``window`` pixels, written to ``path``; ``settle_ms``
        lets the page's scripts run that long (virtual time) first."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            path.unlink()
        settle = [f"--virtual-time-budget={settle_ms}"] if settle_ms else []
        self._run([*settle, f"--screenshot={path}", url], url, window)
        if not path.exists() or path.read_bytes()[:8] != PNG_SIGNATURE:
            raise AssertionError(f"Chromium wrote no PNG to {path} for {redact(url)}")
        return path

    def _run(self, args: list[str], url: str, window: tuple[int, int]) -> str:
        self.runs += 1
        profile = Path(tempfile.mkdtemp(prefix=f"profile{self.runs}-", dir=self.work_dir))
        log_path = self.work_dir / f"chromium-{self.runs}.log"
        argv = [
            self.binary,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            *args,
        ]
        env = {**os.environ, "LANG": "C.UTF-8"}
        env.pop("DISPLAY", None)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            try:
                out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                raise AssertionError(
                    f"Chromium did not finish {redact(url)} within {RUN_TIMEOUT_S} s"
                    f" (log: {log_path})"
                ) from None
            finally:
                # Chromium's helper processes share its session: leave none behind.
                self._kill(proc)
                shutil.rmtree(profile, ignore_errors=True)
        if proc.returncode != 0:
            raise AssertionError(
                f"Chromium exited {proc.returncode} on {redact(url)}:\n"
                f"{log_path.read_text(errors='replace')[-2000:]}"
            )
        return out.decode("utf-8", errors="replace")

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


# --------------------------------------------------------------------------- page reading


VOID_TAGS = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
)


class _PageReader(HTMLParser):
    """The <title>, and each <dt>'s text with its <dd>'s text (whitespace collapsed)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.fields: dict[str, str] = {}
        self._in: str | None = None  # "title", "dt" or "dd"
        self._depth = 0  # nesting inside the current dt/dd
        self._text: list[str] = []
        self._term: str | None = None
        self._hidden_depth = 0  # inside an element screen readers see but eyes don't

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID_TAGS:
            return
        classes = (dict(attrs).get("class") or "").split()
        if self._in in ("dt", "dd"):
            self._depth += 1
            if self._hidden_depth or "visually-hidden" in classes or tag in ("svg", "button"):
                self._hidden_depth += 1
            return
        if tag in ("title", "dt", "dd"):
            self._in, self._depth, self._text = tag, 0, []

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS:
            return
        if self._in in ("dt", "dd") and self._depth > 0:
            self._depth -= 1
            if self._hidden_depth:
                self._hidden_depth -= 1
            return
        if self._in == tag:
            text = " ".join("".join(self._text).split())
            if tag == "title":
                self.title = text
            elif tag == "dt":
                self._term = text
            elif tag == "dd" and self._term is not None:
                self.fields[self._term] = text
                self._term = None
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in is not None and not self._hidden_depth:
            self._text.append(data)


class RenderedPage:
    """What a rendered page shows: its title and its definition-list fields."""

    def __init__(self, html: str) -> None:
        reader = _PageReader()
        reader.feed(html)
        reader.close()
        self.html = html
        self.title = reader.title
        self.fields = reader.fields

    def field(self, name: str) -> str | None:
        return self.fields.get(name)

    def __repr__(self) -> str:
        return f"RenderedPage(title={self.title!r}, fields={self.fields!r})"


def chromium_for_test(work_dir: Path) -> Chromium:
    """A :class:`Chromium` for a browser test: skipped only by ``TEAMDESK_SKIP_BROWSER=1``
    (a person's choice), failed when Chromium cannot be installed."""
    import pytest

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        return Chromium(work_dir)
    except BrowserUnavailable as exc:
        pytest.fail(
            f"headless Chromium is required for this test: {exc} "
            f"(set {SKIP_ENV}=1 to skip it where Chromium cannot be installed)"
        )
