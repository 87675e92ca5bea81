#!/usr/bin/env bash
# Make sure a headless-capable Chromium is installed for the browser test
# (tests/process/test_flower_browser.py). Idempotent: does nothing when `chromium`
# (or the path in $CHROMIUM) is already there.
#
# Installs Debian's `chromium` package non-interactively with apt-get. That needs root
# (or passwordless sudo) and a reachable Debian mirror; when either is missing the
# script says so and exits 1 instead of hanging on a prompt.
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

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: chromium is not installed and there is no apt-get here." >&2
    echo "  Install Chromium yourself and put it on PATH (or set CHROMIUM=/path/to/chromium)." >&2
    exit 1
fi

if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "ensure_chromium: chromium is not installed, and installing it needs root." >&2
    echo "  Run: sudo apt-get update && sudo apt-get install -y chromium" >&2
    exit 1
fi

echo "ensure_chromium: installing Debian's chromium package (apt-get)..." >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get update -q >&2; then
    echo "ensure_chromium: apt-get update failed (is a Debian mirror reachable?)" >&2
    exit 1
fi
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium >&2; then
    echo "ensure_chromium: apt-get install chromium failed" >&2
    exit 1
fi

if ! command -v chromium >/dev/null 2>&1; then
    echo "ensure_chromium: apt-get finished but chromium is still not on PATH" >&2
    exit 1
fi
echo "ensure_chromium: $(chromium --version 2>/dev/null || echo chromium installed)" >&2
