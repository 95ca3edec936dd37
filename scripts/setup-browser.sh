#!/usr/bin/env bash
# The headless browser of the run viewer's tests: Debian's chromium (no browser download; the
# tests drive it with Playwright, installed with the dev extra, pointed at /usr/bin/chromium).
#
#   scripts/setup-browser.sh        idempotent; root installs it, another user is told how
set -euo pipefail

log() { printf 'setup-browser: %s\n' "$*" >&2; }

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
