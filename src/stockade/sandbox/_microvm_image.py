"""The microVM's guest, built on the host: the guest kernel (found in /boot), the initramfs
(static busybox, the virtio modules, the init script, the guest's root helper and the
supervisor) and the root filesystem as a read-only ext4 image. Each is built once per
content and cached.

Apart from ``microvm.py``, which starts, snapshots and restores the guests, because none of
this runs per sandbox: it is image building, and the scripts here run inside the guest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stockade import exceptions as exc
from stockade.sandbox import _builds, _guest, _rules_programs, _trusted
from stockade.sandbox._rootfs import ROOTFS_MARKER, cache_root

MiB = 1024 * 1024
# Loaded by the init script, in this order (dependencies first): the Debian kernel has them as modules.
MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console")
MODULE_PATHS = {
    "virtio_ring": "drivers/virtio/virtio_ring.ko",
    "virtio": "drivers/virtio/virtio.ko",
    "virtio_mmio": "drivers/virtio/virtio_mmio.ko",
    "virtio_blk": "drivers/block/virtio_blk.ko",
    "virtio_console": "drivers/char/virtio_console.ko",
}
PORT_NAME = "stockade"
IMAGE_VERSION = "1"
# Of the guest kernel's command line (2,048 bytes on x86), what the masks may take: the rest
# holds the limits, the clock's and the console's words.
MASK_ARGS_MAX = 1536

# The guest's masks, at boot, chrooted in the root image: argv[1] the paths to mask (commas),
# argv[2] "-", or the programs of /stockade/programs (stdin) that stay, after a comma: every
# other one is masked too. Each is /dev/null bound in its place, then remounted read-only
# without devices or execution (MS_BIND; MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NODEV |
# MS_NOEXEC), as `mount -o bind` then `mount -o remount,bind,ro,nodev,noexec` did. A path
# that is not a file of the image is passed over; any other failure fails the boot: never a
# program left in the view.
MASKER = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
paths = [p for p in sys.argv[1].split(",") if p]
if sys.argv[2] != "-":
    kept = set(sys.argv[2].split(","))
    paths += [p for p in sys.stdin.read().split() if p not in kept]
for p in paths:
    if not os.path.isfile(p):
        continue
    for flags in (4096, 32 | 4096 | 1 | 4 | 8):
        if libc.mount(b"/dev/null", p.encode(), None, flags, None) != 0:
            sys.exit(f"stockade-init: mask {p}: {os.strerror(ctypes.get_errno())}")
"""

# PID 1 of the guest until the supervisor replaces it. Reads the limits from the kernel
# command line; a failure exits, which panics the guest kernel and ends QEMU (-no-reboot).
INIT = """\
#!/bin/busybox sh
B=/bin/busybox
fail() { echo "stockade-init: $*" >/dev/console; exit 1; }
$B mount -t devtmpfs dev /dev
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
for m in MODULES; do $B insmod /lib/modules/$m.ko || fail "insmod $m"; done
egress=""; $B grep -q stockade_egress=1 /proc/cmdline && egress=1
port=""; ctl=""; eport=""; i=0
while :; do
  for f in /sys/class/virtio-ports/*/name; do
    n="$($B cat "$f" 2>/dev/null)"; d=${f%/name}; d=${d##*/}
    [ "$n" = PORT ] && port=$d
    [ "$n" = PORT-ctl ] && ctl=$d
    [ "$n" = PORT-egress ] && eport=$d
  done
  ok=1; [ -n "$egress" ] && { [ -n "$eport" ] && [ -e "/dev/$eport" ] || ok=""; }
  [ -n "$ctl" ] && [ -e "/dev/$ctl" ] || ok=""
  [ -n "$port" ] && [ -e "/dev/$port" ] && [ -e /dev/vda ] && [ -n "$ok" ] && break
  i=$((i+1)); [ $i -gt 5000 ] && fail "virtio devices missing"
  $B usleep 1000
done
for w in $($B cat /proc/cmdline); do
  case $w in
    stockade_ws=*) ws=${w#*=};;
    stockade_tmp=*) tmp=${w#*=};;
    stockade_mask=*) masks=${w#*=};;
    stockade_keep=*) keep=",${w#*=}";;
  esac
done
R=/newroot
$B mount -t ext4 -o ro,noload,nosuid,nodev /dev/vda $R || fail "cannot mount the root image"
# Programs the rules deny, and under an allowlist every ELF program of the image (the list
# in /stockade/programs) but those kept: /dev/null in their place, without its device: no
# read, no run. All in one process (the image's python, the masker), with the guest's /dev lent
# for the bind's source: two busybox mounts for each of an allowlist's ~300 masks took 6-20 s
# of the boot under TCG.
if [ -n "${masks:-}${keep:-}" ]; then
  $B mount -o bind /dev $R/dev || fail "masks: /dev"
  $B chroot $R /usr/bin/python3 -S -I -c MASKER "${masks:-}" "${keep:--}" </stockade/programs \\
    2>/dev/console || fail "masks"
  $B umount $R/dev || fail "masks: /dev"
fi
o=nosuid,nodev,mode=755,uid=1000,gid=1000
$B mount -t tmpfs -o $o,size=${ws%:*},nr_inodes=${ws#*:} ws $R/workspace || fail "workspace"
$B mount -t tmpfs -o nosuid,nodev,size=${tmp%:*},nr_inodes=${tmp#*:},mode=1777 tmp $R/tmp || fail "tmp"
# The sandbox's /dev is its own, as bwrap's --dev and Docker's: the devices anyone may use and
# the links to the descriptors. Not the guest's devtmpfs: its disk, the host's ports, mem, kmsg.
$B mount -t tmpfs -o nosuid,noexec,mode=755,size=64k,nr_inodes=32 dev $R/dev || fail "dev"
for d in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
  n=${d%%:*}; d=${d#*:}; $B mknod -m 666 $R/dev/$n c ${d%:*} ${d#*:} || fail "mknod $n"
done
$B ln -s /proc/self/fd $R/dev/fd && $B ln -s /proc/self/fd/0 $R/dev/stdin || fail "fd"
$B ln -s /proc/self/fd/1 $R/dev/stdout && $B ln -s /proc/self/fd/2 $R/dev/stderr || fail "stdout"
$B mkdir -p $R/dev/shm $R/dev/mqueue
$B mount -t tmpfs -o nosuid,nodev,size=${tmp%:*},nr_inodes=${tmp#*:},mode=1777 shm $R/dev/shm || fail "shm"
$B mount -t mqueue -o nosuid,nodev,noexec mqueue $R/dev/mqueue 2>/dev/null
$B mount -t proc -o nosuid,nodev,noexec proc $R/proc || fail "proc"
$B mount -t tmpfs -o nosuid,nodev,mode=755,size=16m supervisor $R/opt/stockade || fail "supervisor"
$B cp -a /stockade/. $R/opt/stockade/
$B mount -o remount,ro,nosuid,nodev supervisor $R/opt/stockade
$B hostname sandbox
$B ip link set lo up 2>/dev/null
# No TIME_WAIT kept: a connection code closed first would outlive a pool's reset (netstate.py).
echo 0 > /proc/sys/net/ipv4/tcp_max_tw_buckets
# The host's ports, opened here in the guest's own /dev, which the sandbox's never shows.
exec 4<>/dev/$port 3<>/dev/$ctl 0</dev/null 1>/dev/console 2>/dev/console
# The egress port (only with an allowlist): the supervisor's relay reads it as fd 9.
[ -n "$eport" ] && exec 9<>/dev/$eport
$B umount -l /dev /proc /sys
exec $B switch_root $R /bin/sh /opt/stockade/start.sh
"""

# Stage two, in the guest's root. The sandbox gets a pid namespace of its own, whose init is
# the supervisor, without any privilege (as on every tier: code cannot signal its init). This
# shell's place, PID 1 of the guest, goes to the guest's root helper: out of the sandbox's
# sight, it reseeds the kernel's randomness and sets the clock when a snapshot is restored.
START = """\
cd /workspace || exit 1
/usr/bin/unshare --pid --fork --mount --propagation private --mount-proc \\
  /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \\
  /usr/bin/setpriv --reuid 1000 --regid 1000 --clear-groups --inh-caps=-all --bounding-set=-all \\
  --no-new-privs -- ARGV 0<&4 1<&4 3<&- 4<&- &
exec /usr/bin/nice -n 10 /usr/bin/python3 -S -E -s -I /opt/stockade/guestd.py 4<&- 9<&-
"""

# The guest's PID 1 once the sandbox runs (root, outside the sandbox's pid namespace). It
# reads the host's orders on its own port (fd 3, a device only root may open): "S", a time in
# nanoseconds and 32 random bytes: mix them into the kernel's pool, credit them, reseed the
# generator (so two guests restored from one snapshot draw different numbers from the first
# byte on) and set the clock (a snapshot's clock stopped when it was taken); it answers "K".
# "U" says it listens. "N": the sandbox's written places remounted noexec (``remounter``).
# "D", at a pool's reset: the kernel's clean caches dropped, or the next user learns which
# files the last one read (a read with RWF_NOWAIT fails on a page not cached) and which
# paths they looked up (a stat of a cached dentry takes 0.05-0.25 ms, of one not 1.6-49);
# what stays cached is what every user's sandbox holds open or mapped.
# When the sandbox's init ends, so does it (and with it the VM).
GUESTD = """\
import ctypes, fcntl, os, signal, struct, time

LIBC = ctypes.CDLL(None, use_errno=True)  # loaded at boot: the boot image holds it

RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MESSAGE = 41


def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            os._exit(0)
        if pid == 0:
            return
        if pid == SANDBOX:  # the sandbox ended: so does the guest (PID 1's exit)
            said(status)
            os._exit(0)


def said(status):
    # On the console (a file of the host's, read into the error of a sandbox that died
    # unasked): how the sandbox's init ended, and the guest kernel's kills for memory.
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    kills = "?"
    try:
        with open("/proc/vmstat", "rb") as fh:
            kills = next((ln.split()[1].decode() for ln in fh if ln.startswith(b"oom_kill ")), "?")
    except OSError:
        pass
    line = f"stockade: the sandbox ended ({how}); processes the guest killed for memory: {kills}"
    os.write(2, line.encode() + b"\\n")


def seed(data):
    ns = struct.unpack(">Q", data[:8])[0]
    with open("/dev/urandom", "wb", buffering=0) as fh:
        fcntl.ioctl(fh, RNDADDENTROPY, struct.pack("ii", 256, 32) + data[8:40])
        fcntl.ioctl(fh, RNDRESEEDCRNG)
    time.clock_settime_ns(time.CLOCK_REALTIME, ns)


def drop_caches():
    with open("/proc/sys/vm/drop_caches", "wb", buffering=0) as fh:
        fh.write(b"3")  # the page cache (1), dentries and inodes (2)


def remounter(requests, replies):
    # A child of ours, forked at boot (so the boot image holds it: no fork at a sandbox's
    # start): it joins the sandbox's mount namespace (that of the unshare that started it,
    # our other child) and mounts its written places noexec, nothing on them mapped
    # executable (an allowlist's libraries). Not us: setns refuses PID 1 a mount namespace
    # (EINVAL: its fs is the kernel's threads' too). Out of the sandbox's pid namespace.
    while os.read(requests, 1):
        ok = False
        try:
            fd = os.open(f"/proc/{SANDBOX}/ns/mnt", os.O_RDONLY)
            if LIBC.setns(fd, 0x20000) == 0:  # CLONE_NEWNS
                # MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC
                flags = 32 | 4096 | 2 | 4 | 8
                places = (b"/workspace", b"/tmp", b"/dev/shm")
                ok = all(LIBC.mount(None, p, None, flags, None) == 0 for p in places)
            os.close(fd)
        except OSError:
            pass
        os.write(replies, b"K" if ok else b"E")
    os._exit(0)


def start_remounter():
    to_child, requests = os.pipe()[::-1]
    replies, from_child = os.pipe()
    if os.fork() == 0:
        os.close(to_child)
        os.close(replies)
        os.close(3)
        remounter(requests, from_child)
    os.close(requests)
    os.close(from_child)
    return to_child, replies


# Our one child at our start: the unshare that runs the sandbox (start.sh).
SANDBOX = int((open(f"/proc/self/task/{os.getpid()}/children").read().split() or ["0"])[0])
signal.signal(signal.SIGCHLD, reap)
reap()
REMOUNT = start_remounter()
os.write(3, b"U")
buf = b""
while True:
    data = os.read(3, 4096)
    if not data:
        time.sleep(0.05)
        continue
    buf += data
    while buf:
        if buf[:1] == b"N":
            os.write(REMOUNT[0], b"N")
            os.write(3, os.read(REMOUNT[1], 1) or b"E")
            buf = buf[1:]
            continue
        if buf[:1] == b"D":
            try:
                drop_caches()
                os.write(3, b"K")
            except OSError:
                os.write(3, b"E")
            buf = buf[1:]
            continue
        if buf[:1] != b"S":
            buf = buf[1:]
            continue
        if len(buf) < MESSAGE:
            break
        try:
            seed(buf[1:MESSAGE])
            os.write(3, b"K")
        except OSError:
            os.write(3, b"E")
        buf = buf[MESSAGE:]
"""


@dataclass(frozen=True)
class GuestKernel:
    vmlinuz: Path
    modules: Path  # /lib/modules/<version>

    @property
    def version(self) -> str:
        return self.modules.name


def find_kernel() -> GuestKernel | None:
    """``STOCKADE_MICROVM_KERNEL`` (a vmlinuz), else the newest /boot/vmlinuz-* with modules."""
    explicit = os.environ.get("STOCKADE_MICROVM_KERNEL")
    candidates = [Path(explicit)] if explicit else sorted(Path("/boot").glob("vmlinuz-*"), reverse=True)
    for vmlinuz in candidates:
        modules = Path("/lib/modules") / vmlinuz.name.removeprefix("vmlinuz-")
        if vmlinuz.is_file() and all((modules / "kernel" / p).is_file() for p in MODULE_PATHS.values()):
            return GuestKernel(vmlinuz, modules)
    return None


def clock_args(kernel: GuestKernel) -> str:
    """Tell the guest the TSC rate instead of letting it calibrate.

    Under TCG the PIT calibration races the emulator: on a busy host it fails, the guest
    marks its TSC unstable and hangs in early boot (about one boot in four on 2 cores).
    TCG's TSC is the host's, so the host's rate is the right one; skipping the delay-loop
    calibration (``lpj``) also saves boot time.
    """
    khz = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                khz = int(float(line.split(":", 1)[1]) * 1000)
                break
    if khz <= 0:
        return ""
    hz = 250
    with contextlib.suppress(OSError, ValueError):
        config = Path("/boot") / f"config-{kernel.version}"
        for line in config.read_text().splitlines():
            if line.startswith("CONFIG_HZ="):
                hz = int(line.split("=", 1)[1])
    return f"tsc_early_khz={khz} tsc=reliable no_timer_check lpj={khz * 1000 // hz}"


def cache_dir() -> Path:
    return cache_root() / "microvm"


def root_image(rootfs: Path) -> Path:
    """The rootfs as a read-only ext4 image, built once per rootfs content (its build marker)."""
    _trusted.check(rootfs)  # its python compiles the supervisor, chrooted, as us
    marker = (rootfs / ROOTFS_MARKER).read_bytes() if (rootfs / ROOTFS_MARKER).is_file() else b""
    key = hashlib.sha256(repr((str(rootfs), marker, IMAGE_VERSION)).encode()).hexdigest()[:12]
    target = _trusted.check(cache_dir() / f"rootfs-{key}.ext4")
    if target.is_file():
        return target
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    target = _trusted.folder(target.parent) / target.name
    size, files = 0, 0
    for folder, dirs, names in os.walk(rootfs):
        files += len(dirs) + len(names)
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(folder, name)).st_blocks * 512
    fd, tmp = tempfile.mkstemp(prefix=".rootfs-", suffix=".ext4", dir=target.parent)
    os.close(fd)
    try:
        os.truncate(tmp, int(size * 1.2) + 64 * MiB)
        subprocess.run(
            [mkfs, "-q", "-F", "-d", str(rootfs), "-L", "stockade", "-O", "^has_journal", "-m", "0",
             "-N", str(files + 4096), "-E", "root_owner=0:0", tmp],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as err:
        Path(tmp).unlink(missing_ok=True)
        detail = getattr(err, "stderr", b"") or b""
        raise exc.SandboxStartError(
            f"cannot build the microVM root image: {err} {detail.decode(errors='replace')[:500]}"
        ) from None
    return target


# -- the initramfs ---------------------------------------------------------------------------


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data); directories have mode 0o040xxx."""
    out = bytearray()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        encoded = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0)
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return bytes(out)


def image_programs(rootfs: Path) -> tuple[str, ...]:
    """The ELF programs of the guest's image that an allowlist may mask (``_rules_programs.elf_programs``),
    in the order of /stockade/programs."""
    programs = _rules_programs.elf_programs(rootfs, _rules_programs.image_stamp(rootfs))
    return tuple(sorted(inside for inside, _ in programs))


def mask_args(rootfs: Path, masks: tuple[str, ...]) -> str:
    """The kernel command line's words for ``masks``: each named (``stockade_mask``), or, when
    shorter, the image's programs that stay (``stockade_keep``: init masks every other one
    of /stockade/programs). Raises ``LimitNotEnforceable`` where neither fits the command
    line: a list cut short would leave programs unmasked, silently."""
    if not masks:
        return ""
    table = image_programs(rootfs)
    listed = set(table)
    named = f" stockade_mask={','.join(masks)}"
    in_table = {m for m in masks if m in listed}
    if in_table:
        rest = [m for m in masks if m not in listed]
        keep = [p for p in table if p not in in_table]
        kept = f" stockade_keep={','.join(keep)}" + (f" stockade_mask={','.join(rest)}" if rest else "")
        named = min(named, kept, key=len)
    if len(named) > MASK_ARGS_MAX:
        raise exc.LimitNotEnforceable(
            f"the microVM's kernel command line cannot hold the {len(masks)} programs to mask "
            f"({len(named)} characters, {MASK_ARGS_MAX} at most)",
            setting="commands",
            fix="list fewer programs (an allowlist's globs match many), or use the process or docker tier",
        )
    return named


def init_script() -> str:
    """The guest's init (``INIT``), its words filled in."""
    text = INIT.replace("MODULES", " ".join(MODULES)).replace("PORT", PORT_NAME)
    return text.replace("MASKER", shlex.quote(MASKER))


def initramfs(state_dir: Path, kernel: GuestKernel, rootfs: Path, busybox: str) -> Path:
    """The initramfs for ``kernel`` and ``rootfs``, named after its content, built once."""
    kdir = _guest.supervisor_dir(state_dir, str(rootfs))
    if not _guest.has_bytecode(kdir, str(rootfs)):
        _compile(kdir, rootfs)
    argv = " ".join(shlex.quote(a) for a in _guest.SUPERVISOR_ARGV)
    files: dict[str, tuple[int, bytes]] = {
        "init": (0o755, init_script().encode()),
        "bin/busybox": (0o755, Path(busybox).read_bytes()),
        "stockade/start.sh": (0o644, START.replace("ARGV", argv).encode()),
        "stockade/guestd.py": (0o644, GUESTD.encode()),
        # The image's programs, which ``stockade_keep`` masks all but some of (``view_args``).
        "stockade/programs": (0o644, "".join(f"{p}\n" for p in image_programs(rootfs)).encode()),
    }
    for name in MODULES:
        files[f"lib/modules/{name}.ko"] = (
            0o644,
            (kernel.modules / "kernel" / MODULE_PATHS[name]).read_bytes(),
        )
    for path in sorted(kdir.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            files[f"stockade/{path.relative_to(kdir)}"] = (0o644, path.read_bytes())
    # Named after what it runs, not its bytecode: marshal's output need not be reproducible,
    # and a compile may fail under load. Two builds of the same sources get one name, so a
    # memory snapshot's machine key (which names the initramfs) holds in every process and
    # after a rebuild.
    digest = hashlib.sha256(
        b"".join(
            hashlib.sha256(n.encode() + d).digest()
            for n, (_, d) in sorted(files.items())
            if "/__pycache__/" not in n
        )
    ).hexdigest()[:16]
    target = _trusted.check(state_dir / f"microvm-initrd-{digest}.cpio")
    if target.is_file() and _builds.touch(target):
        return target
    dirs = sorted({str(Path(n).parent) for n in files} | {"dev", "proc", "sys", "newroot", "bin", "lib"})
    entries: list[tuple[str, int, bytes]] = []
    for d in dirs:
        parts = Path(d).parts
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub != "." and (sub, 0o040755, b"") not in entries:
                entries.append((sub, 0o040755, b""))
    entries += [(n, 0o100000 | mode, data) for n, (mode, data) in sorted(files.items())]
    fd, tmp = tempfile.mkstemp(prefix=".initrd-", dir=target.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(_cpio(entries))
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    _builds.touch(target)  # this process's now: its own collection spares it
    return target


def _compile(kdir: Path, rootfs: Path) -> None:
    """The rootfs's own python compiles the supervisor (in a chroot, once): best effort."""
    try:
        done = subprocess.run(
            ["chroot", str(rootfs), "/usr/bin/python3", "-S", "-E", "-s", "-c", _guest.COMPILE],
            input=json.dumps(_guest.python_sources(kdir)).encode(),
            capture_output=True,
            env={"PATH": "/usr/bin:/bin"},
            timeout=60,
            check=True,
        )
        _guest.install_bytecode(kdir, str(rootfs), json.loads(done.stdout))
    except (OSError, ValueError, KeyError, subprocess.SubprocessError):
        pass
