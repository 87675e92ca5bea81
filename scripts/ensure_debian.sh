#!/usr/bin/env bash
# Make sure a command a test needs is installed, from Debian's packages.
# Idempotent: does nothing when COMMAND is already on PATH.
#
# Installs PACKAGE non-interactively with apt-get. That needs root (or passwordless
# sudo) and a reachable Debian mirror; when either is missing the script says so and
# exits 1 instead of hanging on a prompt.
#
# Usage: scripts/ensure_debian.sh COMMAND PACKAGE     (make test runs it before pytest)
#   e.g. scripts/ensure_debian.sh faketime faketime
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 COMMAND PACKAGE" >&2
    exit 2
fi
command_name=$1
package=$2

if command -v "${command_name}" >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_debian: ${command_name} is not installed and there is no apt-get here." >&2
    echo "  Install ${package} yourself and put ${command_name} on PATH." >&2
    exit 1
fi

if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "ensure_debian: ${command_name} is not installed, and installing it needs root." >&2
    echo "  Run: sudo apt-get update && sudo apt-get install -y ${package}" >&2
    exit 1
fi

echo "ensure_debian: installing Debian's ${package} package (apt-get)..." >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get update -q >&2; then
    echo "ensure_debian: apt-get update failed (is a Debian mirror reachable?)" >&2
    exit 1
fi
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${package}" >&2; then
    echo "ensure_debian: apt-get install ${package} failed" >&2
    exit 1
fi

if ! command -v "${command_name}" >/dev/null 2>&1; then
    echo "ensure_debian: apt-get finished but ${command_name} is still not on PATH" >&2
    exit 1
fi
echo "ensure_debian: ${command_name} installed from ${package}" >&2
