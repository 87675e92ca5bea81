#!/usr/bin/env bash
# Make sure a headless-capable Chromium is installed for the browser test
# (tests/process/test_flower_browser.py): $CHROMIUM when set, else Debian's `chromium`
# package (scripts/ensure_debian.sh installs it when missing).
#
# Usage: scripts/ensure_chromium.sh      (make test runs it before pytest)
set -euo pipefail

if [[ -n "${CHROMIUM:-}" ]]; then
    if [[ -x "${CHROMIUM}" ]] || command -v "${CHROMIUM}" >/dev/null 2>&1; then
        exit 0
    fi
    echo "ensure_chromium: CHROMIUM=${CHROMIUM} is not an executable" >&2
    exit 1
fi

exec bash "$(dirname "$0")/ensure_debian.sh" chromium chromium
