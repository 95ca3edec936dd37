#!/usr/bin/env bash
# Set up stockade on a fresh Debian/Ubuntu machine: system packages for the embedded
# default tier (bubblewrap, libseccomp, the python3 that runs inside sandboxes), then a
# virtualenv in .venv with stockade and every extra installed (editable).
#
#   scripts/bootstrap.sh            idempotent; a second run is a fast no-op
#
# Root installs the packages with apt-get; as another user, missing packages are listed
# with the command to install them; host settings likewise (scripts/setup-host.sh).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
VENV=${STOCKADE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
# bubblewrap + libseccomp2: the process tier (slirp4netns + iptables: its whole network, walled
# off from the host and the private network); python3/procps/git: what sandboxed code finds
# on the host's read-only /usr (python3-pytest, python3-matplotlib: what agents and notebooks
# expect to find); python3-venv: the virtualenv below; gcc: the exec judge's compiled fast
# path (src/stockade/sandbox/supervisor/judge.c, built below into the cache; without it every
# exec under command rules is judged in Python, slower).
PACKAGES=(bubblewrap libseccomp2 slirp4netns iptables python3 python3-venv python3-pytest python3-matplotlib procps git ca-certificates gcc)

log() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { printf 'bootstrap: ERROR: %s\n' "$*" >&2; exit 1; }

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        die "missing packages: ${missing[*]}; run: sudo apt-get update && sudo apt-get install -y ${missing[*]}"
    fi
    export DEBIAN_FRONTEND=noninteractive
    log "apt-get update"
    apt-get update -qq >&2 || die "apt-get update failed"
    log "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || die "apt-get install failed"
fi

# Host settings the sandboxes' limits rely on (fs.file-max; as root, else it says how).
"$HERE/setup-host.sh"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is older than 3.11; set PYTHON=/path/to/python3.11+"

# The exec judge's library, built once per source into the cache (a no-op when it is there).
build_judge() {
    "$VENV/bin/python" -c 'import platform, sys; from stockade.sandbox import _judge; sys.exit(_judge.build() is None and platform.machine() == "x86_64")' \
        || die "cannot build the exec judge (src/stockade/sandbox/supervisor/judge.c) with gcc"
}

stamp="$VENV/.stockade-installed"
want=$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    build_judge
    exit 0
fi
[[ -x $VENV/bin/python ]] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
log "installing stockade and its extras into $VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
"$VENV/bin/python" -m pip install -q -e "$ROOT[all,dev]" >&2 || die "pip install failed"
echo "$want" > "$stamp"
build_judge
