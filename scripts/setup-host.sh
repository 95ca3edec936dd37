#!/usr/bin/env bash
# Host settings stockade's sandboxes rely on (run as root, once; idempotent):
#
#   fs.file-max = LONG_MAX, as systemd sets it. A sandbox can hold files open through
#   mappings (mmap, then close the descriptor) that its descriptor limit (open_files) never
#   sees; each costs memory charged to its cgroup, so memory_mb bounds them, but not the
#   host-wide count: at a distribution's default (10% of memory / 1 KiB) three default
#   sandboxes took every open file of the host and its other processes got ENFILE. At
#   LONG_MAX, open files are bounded by the memory charged for them.
#
# Written to /etc/sysctl.d so that it lasts across reboots, and applied now.
set -euo pipefail

log() { printf 'setup-host: %s\n' "$*" >&2; }

FILE_MAX=9223372036854775807
CONF=/etc/sysctl.d/60-stockade.conf

if [[ $(id -u) -ne 0 ]]; then
    log "not root: run as root, or set it yourself:"
    log "  echo 'fs.file-max = $FILE_MAX' | sudo tee $CONF && sudo sysctl -w fs.file-max=$FILE_MAX"
    exit 0
fi
if [[ -d /etc/sysctl.d ]] && ! grep -qsx "fs.file-max = $FILE_MAX" "$CONF"; then
    printf '# stockade (scripts/setup-host.sh): open files bounded by the memory charged for them\nfs.file-max = %s\n' \
        "$FILE_MAX" > "$CONF"
fi
if [[ $(cat /proc/sys/fs/file-max) != "$FILE_MAX" ]]; then
    log "fs.file-max: $(cat /proc/sys/fs/file-max) -> $FILE_MAX"
    echo "$FILE_MAX" > /proc/sys/fs/file-max || log "cannot write fs.file-max (a container without its own sysctls?)"
fi
