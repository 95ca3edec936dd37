#!/usr/bin/env bash
# Build the stockade sandbox root filesystem offline (no container registry),
# with debootstrap from the Debian mirror apt is already configured to use.
#
#   * minimal Debian (--variant=minbase) + python3 (also as `python`), curl, the CA bundle,
#     matplotlib and numpy (PyPI wheels, with the project's pip), apt caches and docs stripped;
#   * user `sandbox` (uid/gid 1000, home /home/sandbox), /workspace owned by
#     1000:1000, empty /opt/stockade (the SDK mounts its in-sandbox helper there);
#   * result: a rootfs folder  $STOCKADE_CACHE/rootfs/<key>   (always)
#             and the images   stockade-sandbox:<key>, stockade-sandbox:latest
#             (only when dockerd answers; the rootfs alone serves `runsc` without Docker).
#
# <key> is a short hash of this script's content plus suite and architecture, so an
# unchanged script never rebuilds: a complete rootfs (marker file) skips debootstrap,
# an existing image tag skips `docker import`.
# The last two lines on stdout are `image=...` (empty without Docker) and `rootfs=...`.
#
# Environment knobs:
#   STOCKADE_CACHE   cache dir (default $HOME/.cache/stockade)
#   STOCKADE_SUITE   Debian suite (default bookworm)
#   STOCKADE_MIRROR  Debian mirror URL (default: read from /etc/apt/sources.list{,.d})
#   STOCKADE_IMAGE   image repository name (default stockade-sandbox)
set -euo pipefail

SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(cd "$(dirname "$SCRIPT")/.." && pwd)
CACHE=${STOCKADE_CACHE:-${HOME:-/root}/.cache/stockade}
SUITE=${STOCKADE_SUITE:-bookworm}
IMAGE_REPO=${STOCKADE_IMAGE:-stockade-sandbox}
MARKER=etc/stockade-rootfs          # written last, relative to the rootfs
PACKAGES=python3,python-is-python3,curl,ca-certificates
# From PyPI's wheels, not Debian's packages: Debian's matplotlib depends on scipy, sympy and
# tk (a 1.2 GB image); the wheels are 140 MB with numpy.
WHEELS="matplotlib==3.11.2 numpy==2.4.6"

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { printf 'build-image: ERROR: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap needs chroot and file ownership)"
command -v dpkg >/dev/null || die "this script needs a Debian-based host (dpkg, apt)"

ARCH=$(dpkg --print-architecture)
KEY=$( { cat "$SCRIPT"; printf '\n%s %s\n' "$SUITE" "$ARCH"; } | sha256sum | cut -c1-12)
ROOTFS_DIR=$CACHE/rootfs
ROOTFS=$ROOTFS_DIR/$KEY
IMAGE=$IMAGE_REPO:$KEY

mkdir -p "$ROOTFS_DIR"
exec 9>"$ROOTFS_DIR/.lock"
flock -w 1800 9 || die "another build holds $ROOTFS_DIR/.lock"

# ----------------------------------------------------------- apt helpers ---
APT_UPDATED=0
ensure_pkgs() {   # ensure_pkgs pkg...   (apt-get update at most once per run)
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    export DEBIAN_FRONTEND=noninteractive
    if ((!APT_UPDATED)); then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
        || die "apt-get install ${missing[*]} failed"
}

# The mirror apt uses for SUITE: `apt-get indextargets` reports apt's own reading of
# /etc/apt/sources.list and sources.list.d/ (one-line and deb822 formats, Enabled: no,
# ...), so no hand-written parser is needed.  Prints one URI or nothing.
apt_mirror() {
    # shellcheck disable=SC2016  # $(...) are apt's format fields, not shell
    apt-get indextargets --no-release-info --format '$(TARGET_OF) $(RELEASE) $(REPO_URI)' 2>/dev/null \
        | awk -v s="$1" '$1 == "deb" && $2 == s && $3 ~ /^(https?|file):\/\// { print $3; exit }'
}

# ------------------------------------------------------------ the rootfs ---
build_rootfs() {
    ensure_pkgs debootstrap

    local mirror=${STOCKADE_MIRROR:-} keyring=""
    if [[ -z $mirror ]]; then
        mirror=$(apt_mirror "$SUITE")
        [[ -n $mirror ]] || die "no 'deb' source for suite '$SUITE' in /etc/apt/sources.list{,.d}; set STOCKADE_MIRROR"
    fi
    [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] \
        && keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    log "debootstrap $SUITE/$ARCH (minbase + $PACKAGES) from $mirror"

    local tmp=$ROOTFS.tmp
    cleanup_tmp "$tmp"
    trap 'cleanup_tmp "'"$tmp"'"' EXIT
    mkdir -p "$CACHE/debs"
    local t0=$SECONDS
    # python3 and what agents expect to find: curl and the CA bundle (through the egress
    # proxy, where a policy allows); matplotlib below (figures come back as PNG)
    debootstrap --variant=minbase --include="$PACKAGES" --arch="$ARCH" \
        ${keyring:+--keyring="$keyring"} --cache-dir="$CACHE/debs" \
        "$SUITE" "$tmp" "$mirror" >"$CACHE/debootstrap.log" 2>&1 || {
            tail -n 30 "$CACHE/debootstrap.log" >&2
            die "debootstrap failed (full log: $CACHE/debootstrap.log)"
        }
    log "debootstrap took $((SECONDS - t0)) s"
    install_wheels "$tmp"

    # user, workspace, helper mount point
    chroot "$tmp" groupadd --gid 1000 sandbox
    chroot "$tmp" useradd --uid 1000 --gid 1000 --home-dir /home/sandbox --create-home \
        --shell /bin/bash --comment "stockade sandbox" sandbox
    install -d -m 0755 -o 1000 -g 1000 "$tmp/workspace"
    install -d -m 0755 -o 0 -g 0 "$tmp/opt/stockade"

    # strip caches, docs and logs (keep copyright files)
    chroot "$tmp" apt-get clean >/dev/null 2>&1 || true
    rm -rf "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/apt/*.bin "$tmp"/var/cache/debconf/*-old \
        "$tmp"/usr/share/man/* "$tmp"/usr/share/info/* "$tmp"/usr/share/lintian \
        "$tmp"/usr/share/locale/* "$tmp"/var/log/*.log "$tmp"/var/log/apt/* "$tmp"/tmp/* "$tmp"/var/tmp/*
    find "$tmp/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
    find "$tmp/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
    printf 'key=%s\nsuite=%s\narch=%s\nmirror=%s\nbuilt=%s\n' \
        "$KEY" "$SUITE" "$ARCH" "$mirror" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$tmp/$MARKER"

    rm -rf --one-file-system "$ROOTFS"
    mv "$tmp" "$ROOTFS"
    trap - EXIT
    # drop rootfs folders of older script versions (images stay until `docker image prune`)
    local old
    for old in "$ROOTFS_DIR"/*; do
        [[ -d $old && $old != "$ROOTFS" && $(basename "$old") =~ ^[0-9a-f]{12}(\.tmp)?$ ]] || continue
        log "removing outdated rootfs $old"
        cleanup_tmp "$old"
    done
    log "rootfs built in $((SECONDS - t0)) s: $ROOTFS ($(du -sh "$ROOTFS" | cut -f1))"
}

install_wheels() {   # WHEELS into the rootfs's /usr/local, for its own python3
    local root=$1 pyver pip
    pyver=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    pip=${STOCKADE_VENV:-$ROOT/.venv}/bin/python
    [[ -x $pip ]] || pip=python3
    "$pip" -m pip --version >/dev/null 2>&1 || die "no pip to install $WHEELS into the image: run scripts/bootstrap.sh first"
    log "installing $WHEELS (wheels for python $pyver) into the rootfs"
    local arch=x86_64
    [[ $ARCH == arm64 ]] && arch=aarch64
    "$pip" -m pip install --quiet --no-cache-dir --disable-pip-version-check --no-compile \
        --only-binary=:all: --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" \
        --platform "manylinux2014_$arch" --platform "manylinux_2_28_$arch" --platform "manylinux_2_34_$arch" \
        --target "$root/usr/local/lib/python$pyver/dist-packages" $WHEELS 2>&1 \
        | grep -v -e '^WARNING: Location' -e 'dependency resolver' -e ' requires .* but you have ' >&2 || true
    [[ -d $root/usr/local/lib/python$pyver/dist-packages/matplotlib ]] || die "pip install $WHEELS failed"
    rm -rf "$root/usr/local/lib/python$pyver/dist-packages/bin"
    # compiled by the image's own python: /usr is read-only in a sandbox, so an uncompiled
    # module would be compiled again on every import (seconds for numpy on an emulated VM)
    chroot "$root" python3 -m compileall -q -j 0 "/usr/local/lib/python$pyver/dist-packages" >/dev/null || true
}

cleanup_tmp() {   # unmount anything debootstrap left mounted, then delete
    local d=$1 m
    [[ -e $d ]] || return 0
    while read -r m; do umount -l "$m" 2>/dev/null || true; done \
        < <(awk -v d="$d" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r)
    rm -rf --one-file-system "$d"
}

if [[ -f $ROOTFS/$MARKER ]]; then
    log "rootfs $KEY is complete: skipping debootstrap"
else
    build_rootfs
fi

# ------------------------------------------------------------ the image ----
image_out=""
if command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        log "image $IMAGE exists: skipping import"
    else
        log "docker import -> $IMAGE"
        t0=$SECONDS
        tar --numeric-owner --xattrs -C "$ROOTFS" -cf - . | docker import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
            --change 'ENV PYTHONUNBUFFERED=1' \
            --change 'USER 1000:1000' \
            --change 'WORKDIR /workspace' \
            --change 'CMD ["python3"]' \
            --message "stockade sandbox rootfs $KEY ($SUITE/$ARCH)" \
            - "$IMAGE" >/dev/null || die "docker import failed"
        log "imported in $((SECONDS - t0)) s"
    fi
    if [[ $(docker image inspect -f '{{.Id}}' "$IMAGE_REPO:latest" 2>/dev/null || true) \
          != $(docker image inspect -f '{{.Id}}' "$IMAGE") ]]; then
        docker tag "$IMAGE" "$IMAGE_REPO:latest"
        log "tagged $IMAGE_REPO:latest"
    fi
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
    log "image $IMAGE: $((size / 1024 / 1024)) MiB"
    image_out=$IMAGE
else
    log "dockerd not reachable: rootfs only (run scripts/setup-docker.sh, then this script again, to import the image)"
fi

echo "image=$image_out"
echo "rootfs=$ROOTFS"
