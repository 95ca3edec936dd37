#!/usr/bin/env bash
# The headless browser of the run viewer's tests: Debian's chromium (no browser download) and
# Playwright from PyPI in the virtualenv (the dev extra; installed here if it is missing). The
# tests drive /usr/bin/chromium through Playwright's executable_path, so Playwright's own
# browser builds are never fetched.
#
#   scripts/setup-browser.sh        idempotent; root installs chromium, another user is told how
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
VENV=${STOCKADE_VENV:-$ROOT/.venv}

log() { printf 'setup-browser: %s\n' "$*" >&2; }

if [[ -x $VENV/bin/python ]] && ! "$VENV/bin/python" -c 'import playwright.sync_api' 2>/dev/null; then
    log "installing playwright into $VENV (PyPI; no browser download)"
    "$VENV/bin/python" -m pip install -q "playwright>=1.45" >&2
fi

if dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q 'ok installed' && [[ -x /usr/bin/chromium ]]; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    log "chromium is missing; run: sudo apt-get update && sudo apt-get install -y chromium"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log "apt-get update"
apt-get update -qq >&2
log "installing chromium"
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
