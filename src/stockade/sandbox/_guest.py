"""What the host prepares for a guest: a sandbox with a root filesystem and a python of its
own (the docker, gVisor and microVM tiers). The supervisor folder and its bytecode, compiled by
the guest's python, the boot script, creator identity, host tmpfs, OOM counters, and the OCI
runtime configuration ``runsc`` runs without Docker.

The same supervisor runs on every tier; a container sees it as a read-only bind mount of a
folder named after the hash of its sources, so every process of this host shares one copy
and a stale copy can never be mistaken for the current one.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import resource
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _builds, _host, _rules, _rules_binds, _rules_copies, _trusted
from stockade.sandbox._channel import Stream
from stockade.sandbox._hostinfo import engine_masked_paths
from stockade.sandbox._supervised import Boundary
from stockade.sandbox._supervised_config import WORKSPACE, supervisor_files
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.supervisor import sources as supervisor_sources
from stockade.types import Limits

SUPERVISOR_MOUNT = "/opt/stockade"
SUPERVISOR_ARGV = (
    "python3", "-S", "-E", "-s", "-B", "-c",
    f"import sys; sys.path.insert(0, {SUPERVISOR_MOUNT!r}); import boot; boot.main()",
)  # fmt: skip
NOEXEC_FLAG = "--stockade-noexec"  # BOOT's: the places to make noexec follow, joined by ":"
SANDBOX_UID = 1000
MiB = 1024 * 1024
EGRESS_DIR = "/run/stockade-egress"  # stockade.egress.SANDBOX_DIR: the proxy's socket, read-only
SHM = "/dev/shm"  # POSIX shared memory: a writable place like /tmp, of the same size

# Labels (Docker) and annotations (OCI) that mark what stockade started, and by whom.
LABEL = "stockade.sandbox"
LABEL_ID = "stockade.id"
LABEL_PID = "stockade.pid"
LABEL_CREATOR = "stockade.creator"
LABEL_HOST = "stockade.host"


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/stockade")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return (Path(runtime) if runtime else Path(tempfile.gettempdir())) / f"stockade-{os.getuid()}"


# Runs first in every container: stacks the process tier's seccomp filter on top of the
# engine's profile (which allows ptrace, for one), then becomes the supervisor. Fails closed.
# Given NOEXEC_FLAG and the written places, it first makes them noexec in a view of its own
# (supervisor/noexec.py), which that filter then lets no process undo: it refuses every
# call that makes, joins or changes a namespace or a mount.
# Imported (so it and the supervisor load from bytecode the sandbox's python compiled) and
# built on _ctypes alone: under gVisor, compiling the supervisor, runpy and the ctypes
# package cost ~30 ms of every start.
BOOT = """\
import sys
import _ctypes


class _Long(_ctypes._SimpleCData):
    _type_ = "l"


class _UShort(_ctypes._SimpleCData):
    _type_ = "H"


class _Ptr(_ctypes._SimpleCData):
    _type_ = "P"


class _Char(_ctypes._SimpleCData):
    _type_ = "c"


class _Prog(_ctypes.Structure):
    _fields_ = [("len", _UShort), ("filter", _Ptr)]


class _Func(_ctypes.CFuncPtr):
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Long


class _Libc:
    _handle = _ctypes.dlopen(None)


NOEXEC = "@NOEXEC_FLAG@"


def main():
    if NOEXEC in sys.argv:  # before the filter, which refuses what it takes
        import noexec

        noexec.seal_written(sys.argv[sys.argv.index(NOEXEC) + 1].split(":"))
    prctl = _Func(("prctl", _Libc()))
    prctl.argtypes = (_Long,) * 5
    with open("/opt/stockade/seccomp.bpf", "rb") as fh:
        code = fh.read()
    buf = (_Char * len(code)).from_buffer_copy(code)
    prog = _Prog(len(code) // 8, _ctypes.addressof(buf))
    if prctl(38, 1, 0, 0, 0) != 0 or prctl(22, 2, _ctypes.addressof(prog), 0, 0) != 0:
        import os

        err = os.strerror(_ctypes.get_errno())
        sys.stderr.write("stockade: cannot install the seccomp filter: %s\\n" % err)
        sys.exit(121)
    import supervisor

    supervisor.main()
""".replace("@NOEXEC_FLAG@", NOEXEC_FLAG)

# Compiles the supervisor's sources with the sandbox's own python (bytecode is per Python
# version): sources from a folder or as JSON on stdin; out {"tag": cache tag, "pyc":
# {name: base64}}.
# Unchecked-hash pycs: the folder is named after its content, so they cannot go stale.
COMPILE = """\
import base64, json, os, py_compile, sys, tempfile
if sys.argv[1:]:  # a folder of sources (put there by the engine), else JSON on stdin
    d = sys.argv[1]
    names = [n for n in os.listdir(d) if n.endswith(".py")]
    sources = {n: open(os.path.join(d, n), encoding="utf-8").read() for n in names}
else:
    sources = json.load(sys.stdin)
work = tempfile.mkdtemp()
out = {}
for name, text in sources.items():
    src = os.path.join(work, name)
    with open(src, "w", encoding="utf-8") as fh:
        fh.write(text)
    cfile = py_compile.compile(src, cfile=src + "c", dfile="/opt/stockade/" + name, doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    with open(cfile, "rb") as fh:
        out[name] = base64.b64encode(fh.read()).decode()
json.dump({"tag": sys.implementation.cache_tag, "pyc": out}, sys.stdout)
"""

_supervisor_dirs: dict[tuple[Path, str], Path] = {}


def supervisor_dir(state_dir: Path, python: str) -> Path:
    """A world-readable folder holding the supervisor, its boot script and the seccomp filter.

    Created once per content and per ``python`` (an image id, a rootfs): the bytecode in it
    is compiled by that image's own python, which is as trusted as the image and no more,
    so one image's bytecode must never load in another image's sandboxes.
    """
    from stockade.sandbox import _seccomp

    # Checked at every use, cached or not: were the state folder removed, another user could
    # make one of the same name (in /tmp) with their own boot.py, run first in every container.
    known = _supervisor_dirs.get((state_dir, python))
    if known is not None and _trusted.check(known).is_dir() and _builds.touch(known):
        return known
    blobs = supervisor_sources()
    blobs["boot.py"] = BOOT.encode()
    blobs["seccomp.bpf"] = _seccomp.filter_bpf()
    content = b"".join(blobs[n] for n in sorted(blobs)) + python.encode()
    digest = hashlib.sha256(content).hexdigest()[:16]
    target = _trusted.check(state_dir / f"supervisor-{digest}")
    if target.is_dir() and _builds.touch(target):
        _supervisor_dirs[(state_dir, python)] = target
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".supervisor-", dir=_trusted.folder(state_dir, 0o711)))
    for name, data in blobs.items():
        (tmp / name).write_bytes(data)
        os.chmod(tmp / name, 0o644)
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; theirs is identical
        for name in blobs:
            (tmp / name).unlink(missing_ok=True)
        tmp.rmdir()
    _builds.touch(target)  # this process's now: its own collection spares it
    _supervisor_dirs[(state_dir, python)] = target
    return target


def python_sources(folder: Path) -> dict[str, str]:
    """The modules of a supervisor folder, to compile with the sandbox's python."""
    return {p.name: p.read_text() for p in sorted(folder.glob("*.py"))}


def has_bytecode(folder: Path, key: str) -> bool:
    """Whether the python identified by ``key`` (an image id, a rootfs) compiled ``kernel``."""
    return (folder / f".bytecode-{bytecode_key(key)}").exists()


def mark_bytecode(folder: Path, key: str) -> None:
    with contextlib.suppress(OSError):
        (folder / f".bytecode-{bytecode_key(key)}").touch()


def install_bytecode(folder: Path, key: str, compiled: dict[str, Any]) -> None:
    """Store what ``COMPILE`` printed as ``__pycache__/<name>.<tag>.pyc``, atomically per file."""
    tag = str(compiled["tag"])
    if not tag.replace("-", "").isalnum():
        raise ValueError(f"odd cache tag {tag!r}")
    cache = folder / "__pycache__"
    cache.mkdir(mode=0o755, exist_ok=True)
    os.chmod(cache, 0o755)
    for name, data in compiled["pyc"].items():
        if name not in python_sources(folder):
            raise ValueError(f"unexpected module {name!r}")
        target = cache / f"{name.removesuffix('.py')}.{tag}.pyc"
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".pyc-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(base64.b64decode(data))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    mark_bytecode(folder, key)


def bytecode_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Creator:
    """Who started a sandbox: enough to tell, later, whether that process still runs."""

    host: str
    pid: int
    start_time: str

    @property
    def token(self) -> str:
        return f"{self.pid}:{self.start_time}"

    def alive_here(self, host: str, token: str) -> bool:
        """Whether the creator named by (``host``, ``token``) may still run.

        A sandbox of another host (or pid namespace) is never judged dead from here.
        """
        if host != self.host:
            return True
        pid, _, started = token.partition(":")
        if not pid.isdigit():
            return False
        return _host.start_time(int(pid)) == started


def current_creator() -> Creator:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    # /proc/self/ns/pid tells pid namespaces apart: a pid means nothing across them.
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    host = f"{socket.gethostname()}/{boot}/{pidns}"
    return Creator(host=host, pid=os.getpid(), start_time=_host.start_time(os.getpid()))


def abandon(stream: Stream, boundary: Boundary) -> None:
    """What a sandbox nobody closed gets when it is garbage collected or the interpreter exits."""
    stream.close()
    boundary.kill()


# -- host tmpfs ---------------------------------------------------------------------------


def unreadable_file(state_dir: Path) -> Path:
    """An empty file only root may read: bound over a denied program, it cannot run nor be
    copied (the sandbox's user is never root)."""
    path = _trusted.check(state_dir / "unreadable")
    if not path.exists():
        state_dir = _trusted.folder(state_dir, 0o711)
        fd = os.open(state_dir / f".unreadable-{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0)
        os.close(fd)
        os.chmod(state_dir / f".unreadable-{os.getpid()}", 0)
        os.replace(state_dir / f".unreadable-{os.getpid()}", path)
    return path


def mask_binds(
    masks: tuple[str, ...], *, root: Path | None, state_dir: Path, rundir: Path | None
) -> list[tuple[str, str]]:
    """What a gVisor sandbox binds over its masked programs, as its kernel ignores masked
    paths (``_rules_binds.own_kernel_binds``): an empty file only root may read over each, or
    masked copies of their folders, made (as root) of the image's files on this host at
    ``root``. ``rundir``, the sandbox's run folder, lists the copies: garbage collection
    keeps them while it is there."""
    if not masks:
        return []
    cover = str(unreadable_file(state_dir))
    cache = None
    if root is not None and rundir is not None and os.geteuid() == 0:
        cache = _rules_copies.MaskCache(
            _rules_copies.masked_folders(), functools.partial(_rules_copies.masks_in_use, state_dir)
        )
    binds = _rules_binds.own_kernel_binds(root, masks, cover, cache)
    copies = [source for source, _ in binds if source != cover]
    if copies and rundir is not None:
        (rundir / _rules_copies.MASKS_FILE).write_text("".join(f"{copy}\n" for copy in copies))
    return binds


def mount_tmpfs(
    target: Path, *, size: int, inodes: int, mode: int, uid: int = SANDBOX_UID, noexec: bool = False
) -> None:
    """A size- and inode-limited tmpfs owned by the sandbox user (needs root)."""
    _host.mount_tmpfs(target, size=size, inodes=inodes, uid=uid, mode=mode, noexec=noexec)


umount = _host.umount


def etc_files(uid: int) -> dict[str, str]:
    """The accounts a sandbox sees: its own uid is ``sandbox`` (``whoami``, ``~``, git work)."""
    return {
        "passwd": f"root:x:0:0::/:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
        "nobody:x:65534:65534::/:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n",
    }


def tmpfs_sizes(spec: SandboxSpec) -> dict[str, tuple[int, int, int]]:
    """Mount point -> (bytes, inodes, mode) of the writable places, as on every tier.

    /dev/shm is one of them: the engine's own shm mount (and gVisor's tmpfs) has no inode
    limit, and empty files, which no size limit counts, cost kernel memory until the
    sandbox is killed for memory instead of failing with ENOSPC."""
    limits = spec.limits
    scratch = (limits.tmp_size_mb * MiB, limits.scratch_inodes, 0o1777)
    return {
        WORKSPACE: (limits.workspace_mb * MiB, limits.workspace_inodes, 0o755),
        "/tmp": scratch,
        SHM: scratch,
    }


def host_folder(target: str) -> str:
    """The name of a writable place's host side in a sandbox's folder (its role in a snapshot)."""
    return PurePosixPath(target).name


# gVisor's own share of its host cgroup, on top of memory_mb: its kernel (a Go runtime) and
# gofer, idle, held 14-16 MiB beyond the memory its processes and files use (measured:
# cgroup usage less shmem, under Docker and runsc). What it holds for the code beyond that
# (page tables, tasks: ~0.4 MiB a process, socket buffers, pipes) counts against memory_mb,
# as a container's kernel memory does on Docker. So files and processes together pass
# memory_mb by at most the idle kernel's unused rest, about 16 MiB (it was 128 MiB flat:
# 171 MiB of files and a 140 MiB process lived at memory_mb=256).
SENTRY_MEMORY = 32 * MiB
# Host tasks of a gVisor sandbox on the systrap platform: its own threads, and per process
# inside a stub (measured: 125 processes take 260-330 host tasks, given back when they exit).
GVISOR_OWN_TASKS = 256
GVISOR_TASKS_PER_PROCESS = 4
# Host descriptors of a gVisor sandbox. Its kernel holds about two host descriptors for each
# file of a host mount that is open inside, mapped (``mmap``, then ``close``: no descriptor
# inside counts it) or cached (a dentry it keeps after the last close); measured, 6,000
# mappings of closed files held 12,205. So stockade gives gVisor's kernel and its gofer a
# descriptor limit each (runsc's ``--fdlimit``, a prlimit under Docker) sized for
# ``total_open_files`` such files, its cache and its own (GVISOR_OWN_FILES), and bounds the
# cache (``--dcache``): past the limit the sandbox's opens and mmaps of host files fail
# with EMFILE, and what code holds is freed when it is killed.
GVISOR_OWN_FILES = 1024
GVISOR_HOST_FDS_PER_FILE = 2
GVISOR_DCACHE = 1000  # --dcache: the dentries its kernel keeps cached, all mounts together
# Without --dcache (a Docker runtime registered without it) gVisor caches 1,000 per mount:
# the image's root, the workspace, /tmp, the supervisor's folder, the egress folder.
GVISOR_MOUNT_DCACHE = 1000
GVISOR_CACHED_MOUNTS = 5
# runsc's launcher (``runsc run``, or the engine's shim) holds a fixed handful of its own.
GVISOR_LAUNCHER_FILES = 32


def gvisor_fd_limit(limits: Limits, dcache: int | None = GVISOR_DCACHE) -> int:
    """RLIMIT_NOFILE of gVisor's kernel and of its gofer, each; ``dcache``: the runtime's
    ``--dcache``, None where it has none (a cache per mount)."""
    cached = dcache if dcache is not None else GVISOR_MOUNT_DCACHE * GVISOR_CACHED_MOUNTS
    return GVISOR_OWN_FILES + GVISOR_HOST_FDS_PER_FILE * (cached + limits.total_open_files)


def gvisor_host_files(fd_limit: int) -> int:
    """The host descriptors a gVisor sandbox can hold: its kernel's and its gofer's limit,
    and its launcher's few."""
    return 2 * fd_limit + GVISOR_LAUNCHER_FILES


def limit_gvisor_files(sentry: int, limit: int) -> None:
    """RLIMIT_NOFILE ``limit`` on gVisor's kernel (``sentry``: the container's pid under
    Docker) and on its gofer (the sibling runsc-gofer the same shim started), from the host
    (root): what runsc's ``--fdlimit`` does, which a Docker runtime cannot set per container."""
    try:
        parent = int(Path(f"/proc/{sentry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        gofers = [pid for pid in _children(parent) if _command(pid).startswith(b"runsc-gofer")]
        if len(gofers) != 1:
            raise OSError(f"{len(gofers)} runsc-gofer processes beside gVisor's kernel (pid {sentry})")
        for pid in (sentry, *gofers):
            # never above the engine's own (raising needs CAP_SYS_RESOURCE): at most ``limit``
            most = min(limit, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1])
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (most, most))
    except (OSError, ValueError, IndexError) as err:
        raise exc.SandboxStartError(f"cannot bound gVisor's host descriptors: {err}") from err


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


@dataclass(frozen=True)
class OwnKernelLimits:
    """How limits apply when the sandbox runs its own kernel (gVisor).

    gVisor's kernel runs on host threads and host stub processes, and is charged to the
    sandbox's cgroup; a cgroup limit that is hit kills the whole sandbox rather than one
    process. So the sandbox kernel enforces the limits per process first (RLIMIT_NPROC counts
    the sandbox user's processes, the only ones inside: an exact per-sandbox limit; RLIMIT_AS
    stops one hog with a MemoryError), and the host cgroup bounds the whole sandbox: the
    memory limit plus ``SENTRY_MEMORY`` for gVisor's own idle kernel, and host tasks sized by platform.
    On systrap, gVisor takes about 2.5 host tasks per process it runs and gives them back;
    on ptrace, about 7, and it keeps them after its processes exit (a pool it never
    shrinks: three fork storms of 128 processes left 1,800 host tasks), so there only a
    backstop can be set, far above ``pids``, and a sandbox that reaches it dies.
    """

    rlimits: dict[str, int]
    host_memory: int
    host_pids: int


def own_kernel_limits(spec: SandboxSpec, platform: str = "systrap") -> OwnKernelLimits:
    limits = spec.limits
    if platform == "ptrace":
        host_pids = max(4096, limits.pids * 32)
    else:
        host_pids = limits.pids * GVISOR_TASKS_PER_PROCESS + GVISOR_OWN_TASKS
    return OwnKernelLimits(
        rlimits={"RLIMIT_NPROC": limits.pids, "RLIMIT_AS": limits.memory_mb * MiB},
        host_memory=limits.memory_mb * MiB + SENTRY_MEMORY,
        host_pids=host_pids,
    )


# -- the OCI runtime configuration (runsc without Docker) -----------------------------------


def oci_config(
    spec: SandboxSpec,
    *,
    rootfs: Path,
    folder: Path,
    binds: dict[str, Path],
    cgroup: str,
    annotations: dict[str, str],
    host: OwnKernelLimits,
    mask_binds: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """The ``config.json`` of a bundle: the same limits Docker applies to its containers.
    ``mask_binds``: (host source, inside path) bound read-only over the masked programs, as
    gVisor does not apply maskedPaths (``_rules_binds.own_kernel_binds``)."""
    limits = spec.limits
    period = 100_000
    # gVisor's kernel reads its mounts' flags from here, not from the host tmpfs under them:
    # without noexec in its own view it runs a file the code wrote (_rules.written_noexec).
    written = set(tmpfs_sizes(spec)) if _rules.written_noexec(spec) else set()
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {
            "destination": SUPERVISOR_MOUNT,
            "type": "bind",
            "source": str(folder),
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },
    ]
    for target, source in binds.items():
        options = ["rbind", "ro" if target == EGRESS_DIR else "rw", "nosuid", "nodev"]
        if target in written:
            options.append("noexec")
        mounts.append({"destination": target, "type": "bind", "source": str(source), "options": options})
    for cover, inside in mask_binds:
        mounts.append({"destination": inside, "type": "bind", "source": cover, "options": ["bind", "ro"]})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": SANDBOX_UID, "gid": SANDBOX_UID, "additionalGids": [SANDBOX_UID]},
            "args": list(SUPERVISOR_ARGV),
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": WORKSPACE,
            "capabilities": {
                "bounding": [],
                "effective": [],
                "inheritable": [],
                "permitted": [],
                "ambient": [],
            },
            "rlimits": [
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                # The supervisor's (its relay's besides): it gives what it starts the code's.
                {"type": "RLIMIT_NOFILE", "hard": supervisor_files(limits), "soft": supervisor_files(limits)},
            ],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "annotations": annotations,
        "linux": {
            "cgroupsPath": cgroup,
            "resources": {
                "memory": {"limit": host.host_memory, "swap": host.host_memory},
                "cpu": {"quota": int(limits.cpus * period), "period": period},
                "pids": {"limit": host.host_pids},
            },
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": engine_masked_paths(),
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def read_oom_kills(counter: Path) -> int | None:
    return _read_counter(counter, "oom_kill")


def _read_counter(path: Path, key: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None
