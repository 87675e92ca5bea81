#!/usr/bin/env bash
# Make sure a headless-capable Chromium is installed for the browser test
# (tests/process/test_flower_browser.py): $CHROMIUM when set, else Debian's `chromium`
# package (scripts/ensure_debian.sh installs it when missing).
#
# Usage: scripts/ensure_chromium.sh      (make test runs it before pytest)
#
# TEAMDESK_SKIP_BROWSER=1: install nothing; the browser test then skips itself, saying why
# (for machines where apt-get cannot run). Never set it in CI: the test runs by default.
set -euo pipefail

if [[ "${TEAMDESK_SKIP_BROWSER:-}" == "1" ]]; then
    echo "ensure_chromium: TEAMDESK_SKIP_BROWSER=1: not installing Chromium;" \
        "tests/process/test_flower_browser.py will be skipped" >&2
    exit 0
fi

if [[ -n "${CHROMIUM:-}" ]]; then
    if [[ -x "${CHROMIUM}" ]] || command -v "${CHROMIUM}" >/dev/null 2>&1; then
        exit 0
    fi
    echo "ensure_chromium: CHROMIUM=${CHROMIUM} is not an executable" >&2
    exit 1
fi

exec bash "$(dirname "$0")/ensure_debian.sh" chromium chromium
