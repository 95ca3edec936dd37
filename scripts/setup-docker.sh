#!/usr/bin/env bash
# Host setup for the docker and gvisor tiers (Debian/Ubuntu, run as root).
#
#   * apt-installs docker.io and runsc (gVisor) when missing (runsc from
#     <codename>-backports on bookworm, see "packages" below);
#   * registers runsc as a Docker runtime in /etc/docker/daemon.json
#     (runtimeArgs --platform=systrap where it runs, else ptrace: the KVM platform
#     hangs on nested hosts; plus --network=none for old runsc on new kernels, see below;
#     --host-uds=open for the egress proxy's socket; --dcache=1000, the closed files gVisor
#     keeps cached, which holds host descriptors);
#   * picks the storage driver: overlay2 when an overlay mount works on the
#     data root, vfs otherwise;
#   * starts dockerd in the background when it is not answering (no systemd
#     needed), clearing stale pid files / sockets left by a previous run;
#   * verifies that `docker info` answers and lists the runsc runtime.
#
# Idempotent: a second run is a fast no-op.  Messages go to stderr.
# Environment knobs:
#   STOCKADE_DOCKERD_LOG      dockerd log file  (default /var/log/stockade-dockerd.log)
#   STOCKADE_DOCKERD_TIMEOUT  seconds to wait for dockerd (default 60)
#   STOCKADE_STORAGE_DRIVER   force a storage driver (e.g. vfs) instead of probing
#   STOCKADE_RUNSC_NETWORK    force runsc's --network (none|sandbox) instead of detecting
#   STOCKADE_GVISOR_PLATFORM  force runsc's --platform (systrap|ptrace) instead of probing
#   STOCKADE_RUNSC_SOURCE     auto (default) | stable | backports: where runsc comes from
set -euo pipefail

DAEMON_JSON=/etc/docker/daemon.json
DOCKERD_LOG=${STOCKADE_DOCKERD_LOG:-/var/log/stockade-dockerd.log}
TIMEOUT=${STOCKADE_DOCKERD_TIMEOUT:-60}
PIDFILE=/var/run/docker.pid
SOCK=/var/run/docker.sock
CONTAINERD_SOCK=/run/containerd/containerd.sock
DATA_ROOT=/var/lib/docker

log() { printf 'setup-docker: %s\n' "$*" >&2; }
die() { printf 'setup-docker: ERROR: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, starts dockerd)"

# --------------------------------------------------------------- packages ---
# runsc older than RUNSC_MIN (e.g. bookworm's 0.0~20221219) rejects the statx()
# flags of current coreutils with EINVAL, so `ls`, `stat`, `cp -a`... fail inside
# the sandbox.  On bookworm the fixed build is in bookworm-backports; with
# STOCKADE_RUNSC_SOURCE=auto (default) that suite is added (apt pins backports
# low, so nothing else is taken from it) and runsc alone is installed from it.
RUNSC_MIN=0.0~20240101
RUNSC_SOURCE=${STOCKADE_RUNSC_SOURCE:-auto}
BPO_LIST=/etc/apt/sources.list.d/stockade-backports.sources
export DEBIAN_FRONTEND=noninteractive

installed_version() { { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null || true; } | awk '$3 == "installed" { print $4 }'; }

# shellcheck source=/dev/null
codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
case $RUNSC_SOURCE in
    auto) [[ $codename == bookworm ]] && RUNSC_SOURCE=backports || RUNSC_SOURCE=stable ;;
    stable|backports) ;;
    *) die "STOCKADE_RUNSC_SOURCE must be auto, stable or backports (got '$RUNSC_SOURCE')" ;;
esac

install=()
[[ -n $(installed_version docker.io) ]] || install+=(docker.io)
runsc_have=$(installed_version runsc)
if [[ $RUNSC_SOURCE == backports ]]; then
    [[ -n $codename ]] || die "cannot tell the distribution codename (VERSION_CODENAME in /etc/os-release)"
    if [[ -z $runsc_have ]] || dpkg --compare-versions "$runsc_have" lt "$RUNSC_MIN"; then
        # shellcheck disable=SC2016  # $(...) are apt's format fields, not shell
        if ! apt-get indextargets --no-release-info --format '$(RELEASE)' 2>/dev/null | grep -qx "$codename-backports"; then
            # same mirror as the configured base suite
            # shellcheck disable=SC2016
            repo=$(apt-get indextargets --no-release-info --format '$(TARGET_OF) $(RELEASE) $(REPO_URI)' 2>/dev/null \
                   | awk -v s="$codename" '$1 == "deb" && $2 == s { print $3; exit }')
            [[ -n $repo ]] || die "no apt source for '$codename' found to derive $codename-backports from"
            keyring=/usr/share/keyrings/debian-archive-keyring.gpg
            log "adding $codename-backports ($repo) in $BPO_LIST for runsc >= $RUNSC_MIN"
            printf 'Types: deb\nURIs: %s\nSuites: %s-backports\nComponents: main\n%s' \
                "$repo" "$codename" "$([[ -f $keyring ]] && echo "Signed-By: $keyring")" >"$BPO_LIST"
        fi
        install+=("runsc/$codename-backports")
    fi
elif [[ -z $runsc_have ]]; then
    install+=(runsc)
fi

if ((${#install[@]})); then
    command -v apt-get >/dev/null || die "need ${install[*]} and there is no apt-get to install them"
    log "apt-get update"
    apt-get update -qq >&2 || die "apt-get update failed"
    log "installing ${install[*]}"
    apt-get install -y -qq --no-install-recommends "${install[@]}" >&2 \
        || die "apt-get install ${install[*]} failed"
fi
runsc_have=$(installed_version runsc)
if dpkg --compare-versions "${runsc_have:-0}" lt "$RUNSC_MIN"; then
    log "WARNING: runsc $runsc_have is older than $RUNSC_MIN: coreutils' ls/stat fail inside gVisor (statx EINVAL)"
fi

RUNSC=$(command -v runsc || true)
[[ -n $RUNSC ]] || die "runsc not found on PATH after installing the runsc package"
command -v dockerd >/dev/null || die "dockerd not found after installing docker.io"
command -v docker >/dev/null || die "docker CLI not found"

# runsc releases before mid-2024 decide "am I in the root network namespace?" by
# looking for /proc/sys/net/core/rmem_default, which kernels >= 6.11 show in every
# namespace (gVisor issue 10704); every Docker container then fails with "cannot run
# with network enabled in root network namespace".  stockade sandboxes have no
# network anyway, so such a runsc gets --network=none (loopback-only netstack).
runsc_network=${STOCKADE_RUNSC_NETWORK:-}
if [[ -z $runsc_network ]]; then
    runsc_date=$("$RUNSC" --version 2>/dev/null | grep -oE '20[0-9]{6}' | head -n1 || true)
    if [[ -n $runsc_date ]] && ((runsc_date < 20240801)) \
        && unshare -n test -e /proc/sys/net/core/rmem_default 2>/dev/null; then
        runsc_network=none
        log "runsc $runsc_date misdetects network namespaces on kernel $(uname -r): using --network=none"
    fi
fi
# systrap keeps a bounded number of host tasks per sandbox (ptrace keeps every stub it made).
platform=${STOCKADE_GVISOR_PLATFORM:-}
if [[ -z $platform ]]; then
    if timeout 60 "$RUNSC" --platform=systrap --network=none do true >/dev/null 2>&1; then
        platform=systrap
    else
        platform=ptrace
        log "runsc's systrap platform does not run here: using ptrace"
    fi
fi
# --host-uds=open lets a sandbox connect to a host Unix socket bound into it: stockade binds
# exactly one, its egress proxy's, and only for a sandbox with a network allowlist.
# --dcache=1000: gVisor keeps 1,000 closed files cached in all (two host descriptors each)
# rather than 1,000 per mount; stockade sizes each sandbox's descriptor limit with it.
RUNSC_ARGS=(--platform=$platform ${runsc_network:+--network=$runsc_network} --host-uds=open --dcache=1000)

PY=$(command -v /usr/bin/python3 || command -v python3 || true)
[[ -n $PY ]] || die "python3 is needed to edit $DAEMON_JSON"

# --------------------------------------------------------- storage driver ---
probe_overlay() {   # can we mount overlayfs on the data root's filesystem?
    mkdir -p "$DATA_ROOT"
    local d rc=1
    d=$(mktemp -d "$DATA_ROOT/.stockade-overlay-probe.XXXXXX")
    mkdir -p "$d/lower" "$d/upper" "$d/work" "$d/merged"
    echo x >"$d/lower/f"
    if mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null; then
        # a write through the merged dir must land in upper (copy-up works)
        if echo y >>"$d/merged/f" 2>/dev/null && [[ -f $d/upper/f ]]; then rc=0; fi
        umount "$d/merged" 2>/dev/null || umount -l "$d/merged" 2>/dev/null || true
    fi
    rm -rf "$d"
    return $rc
}

current_driver=""
if [[ -f $DAEMON_JSON ]]; then
    current_driver=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("storage-driver",""))' "$DAEMON_JSON" 2>/dev/null) \
        || die "$DAEMON_JSON is not valid JSON; fix or remove it"
fi
want_driver=""          # "" = leave docker's default (overlay2)
if [[ -n ${STOCKADE_STORAGE_DRIVER:-} ]]; then
    want_driver=$STOCKADE_STORAGE_DRIVER
elif [[ -n $current_driver ]]; then
    want_driver=$current_driver          # respect an existing explicit choice
elif probe_overlay; then
    log "overlayfs works on $DATA_ROOT: storage driver overlay2 (docker default)"
else
    log "overlayfs does not work on $DATA_ROOT: falling back to storage driver vfs (slow, uses more disk)"
    want_driver=vfs
fi

# ------------------------------------------------------------ daemon.json ---
mkdir -p "$(dirname "$DAEMON_JSON")"
changed=$("$PY" - "$DAEMON_JSON" "$RUNSC" "$want_driver" "${RUNSC_ARGS[@]}" <<'EOF'
import json, os, sys
path, runsc, driver, want = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
try:
    with open(path) as f:
        text = f.read()
    cfg = json.loads(text) if text.strip() else {}
except FileNotFoundError:
    cfg = {}
if not isinstance(cfg, dict):
    sys.exit("daemon.json is not a JSON object")
before = json.dumps(cfg, sort_keys=True)
rt = cfg.setdefault("runtimes", {})
entry = rt.get("runsc") if isinstance(rt.get("runsc"), dict) else {}
entry["path"] = runsc
ours = {a.split("=", 1)[0] for a in want}          # flags this script owns
keep = [a for a in entry.get("runtimeArgs", []) if a.split("=", 1)[0] not in ours]
if "--network" not in ours:                        # drop a --network we set earlier
    keep = [a for a in keep if a != "--network=none"]
entry["runtimeArgs"] = want + keep
rt["runsc"] = entry
if driver:
    cfg["storage-driver"] = driver
if json.dumps(cfg, sort_keys=True) == before:
    print("no")
else:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    print("yes")
EOF
) || die "could not update $DAEMON_JSON"
[[ $changed == yes ]] && log "wrote $DAEMON_JSON (runsc runtime${want_driver:+, storage-driver $want_driver})"

# ---------------------------------------------------------------- dockerd ---
docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

running() {   # running PID: alive and not a zombie (PID 1 here may not reap orphans)
    local st
    st=$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

pid_alive() {   # pid_alive PIDFILE NAME  -> prints the pid when it runs NAME
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && running "$pid" || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
    echo "$pid"
}

wait_docker() {
    local deadline=$((SECONDS + TIMEOUT))
    until docker_ok; do
        if ((SECONDS >= deadline)); then
            tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "dockerd did not answer within ${TIMEOUT}s (log: $DOCKERD_LOG)"
        fi
        if [[ -n ${1:-} ]] && ! running "$1"; then
            tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "dockerd exited during start-up (log: $DOCKERD_LOG)"
        fi
        sleep 0.5
    done
}

if docker_ok; then
    if [[ $changed == yes ]]; then
        if pid=$(pid_alive "$PIDFILE" dockerd); then
            log "dockerd running (pid $pid): reloading configuration (SIGHUP)"
            kill -HUP "$pid"
            sleep 1
            if [[ -n $want_driver ]] && [[ $(docker info --format '{{.Driver}}') != "$want_driver" ]]; then
                log "WARNING: storage-driver change needs a dockerd restart; current driver kept"
            fi
        else
            log "WARNING: $DAEMON_JSON changed but the running dockerd is not ours to reload; restart it"
        fi
    fi
else
    if pid=$(pid_alive "$PIDFILE" dockerd); then
        log "dockerd (pid $pid) is running but not answering yet; waiting"
        wait_docker "$pid"
    else
        # clear leftovers of a dead daemon so they cannot block the start
        [[ -e $PIDFILE ]] && { log "removing stale $PIDFILE"; rm -f "$PIDFILE"; }
        [[ -S $SOCK || -e $SOCK ]] && { log "removing stale $SOCK"; rm -f "$SOCK"; }
        # a containerd socket without a containerd makes dockerd try (and fail) to use it
        if [[ -e $CONTAINERD_SOCK ]] && ! pgrep -x containerd >/dev/null; then
            log "removing stale $CONTAINERD_SOCK"; rm -f "$CONTAINERD_SOCK"
        fi
        if [[ -e /var/run/docker/containerd/containerd.pid ]] && ! pid_alive /var/run/docker/containerd/containerd.pid containerd >/dev/null; then
            rm -f /var/run/docker/containerd/containerd.pid
        fi
        mkdir -p "$(dirname "$DOCKERD_LOG")"
        log "starting dockerd (log: $DOCKERD_LOG)"
        setsid nohup dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
        dpid=$!
        disown "$dpid" 2>/dev/null || true
        wait_docker "$dpid"
        log "dockerd is up (pid $dpid)"
    fi
fi

# ----------------------------------------------------------------- verify ---
runtimes=$(docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>/dev/null) \
    || die "docker info failed"
[[ " $runtimes " == *" runsc "* ]] || die "docker info does not list the runsc runtime (runtimes: $runtimes)"
driver=$(docker info --format '{{.Driver}}')
log "ok: dockerd answers; runtimes: ${runtimes% }; storage driver: $driver"
