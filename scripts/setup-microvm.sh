#!/usr/bin/env bash
# Set up the microVM tier: QEMU, a guest kernel with the virtio modules, static busybox, the
# offline root filesystem (build-image.sh), then the guest's ext4 root image and initramfs.
# Every step is skipped when already done: the images are cached under names derived from
# their content (the rootfs's build marker, the supervisor's sources, the kernel's modules).
#
#   scripts/setup-microvm.sh     (as root; prints the image, initrd and rootfs paths)
#   PYTHON=...                   the interpreter with stockade installed (default .venv/bin/python)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

log() { printf 'setup-microvm: %s\n' "$*" >&2; }
die() { printf 'setup-microvm: ERROR: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (packages, the guest kernel in /boot, the image build)"

missing=()
for p in qemu-system-x86 busybox-static e2fsprogs util-linux bubblewrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
# Any installed kernel image with the virtio modules will do; the cloud flavour is the smallest.
compgen -G '/boot/vmlinuz-*' >/dev/null || missing+=(linux-image-cloud-amd64)
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || die "apt-get install failed"
fi

rootfs=$("$HERE/build-image.sh" | sed -n 's/^rootfs=//p')
[[ -n $rootfs ]] || die "build-image.sh printed no rootfs"
t0=$SECONDS
STOCKADE_ROOTFS=$rootfs "${PYTHON:-$ROOT/.venv/bin/python}" - <<'PY'
from stockade.sandbox.microvm import MicroVMBackend

image, initrd = MicroVMBackend().prepare()
print(f"image={image}")
print(f"initrd={initrd}")
PY
log "guest images ready in $((SECONDS - t0)) s"
echo "rootfs=$rootfs"
