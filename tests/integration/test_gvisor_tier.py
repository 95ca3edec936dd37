"""gVisor specifics: its own kernel, and the mode without Docker (runsc on an OCI bundle)."""

from __future__ import annotations

import os
import platform
import struct
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import Limits, Sandbox
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.base import Backend
from stockade.sandbox.docker import DockerBackend
from stockade.sandbox.gvisor import GVisorBackend, RunscBackend
from stockade.types import SandboxRules
from tests.conftest import require, require_tier

pytestmark = pytest.mark.gvisor


@pytest.fixture
def direct() -> Iterator[RunscBackend]:
    backend = RunscBackend()
    report = backend.probe()
    require("runsc without Docker", report.available, report.detail)
    yield backend


def test_gvisor_shows_its_own_kernel() -> None:
    require_tier("gvisor")
    with Sandbox.create("gvisor") as sbx:
        inside = sbx.commands.run("uname -r").stdout.strip()
    assert inside and inside != platform.release()


def test_runsc_without_docker_behaves_like_every_tier(direct: RunscBackend) -> None:
    with Sandbox.create(backend=direct, limits=Limits(memory_mb=256, timeout_s=10)) as sbx:
        assert sbx.commands.run("uname -r").stdout.strip() != platform.release()
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
        sbx.files.write("src/a.txt", "hello")
        assert sbx.commands.run("cat src/a.txt; echo; id -u").stdout == "hello\n1000\n"
        slow = sbx.commands.run("sleep 30", timeout_s=1)
        assert slow.timed_out
        bundle = direct.state_dir / f"gv-{sbx.id}"
        assert bundle.is_dir()
    assert not bundle.exists()


def test_runsc_without_docker_refuses_network(direct: RunscBackend) -> None:
    from stockade import exceptions as exc
    from stockade.types import NetworkPolicy

    with pytest.raises(exc.LimitNotEnforceable):
        Sandbox.create(backend=direct, network=NetworkPolicy(enabled=True))


def test_gvisor_under_docker_loads_the_supervisor_from_bytecode_compiled_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The image's own python compiles the supervisor once per image, in a helper container:
    # under gVisor too, whose writes to a container's root filesystem the engine cannot read.
    def gvisor_under_docker() -> DockerBackend:
        return DockerBackend(runtime="runsc", tier="gvisor", own_kernel=True, state_dir=tmp_path)

    backend = gvisor_under_docker()
    require("gVisor under Docker", backend.probe().available)
    with Sandbox.create(backend=backend, limits=Limits(timeout_s=20)) as sbx:
        cached = sbx.commands.run(["ls", "/opt/stockade/__pycache__"]).stdout.split()
    assert any(name.startswith("supervisor.") and name.endswith(".pyc") for name in cached)
    assert not [r for r in caplog.records if "bytecode" in r.getMessage()]
    (folder,) = tmp_path.glob("supervisor-*")
    compiled = {p.name: p.stat().st_ino for p in folder.glob("__pycache__/*.pyc")}
    # Once, not per start nor per backend: the next backend's sandboxes load the same files.
    with Sandbox.create(backend=gvisor_under_docker(), limits=Limits(timeout_s=20)) as sbx:
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
    assert {p.name: p.stat().st_ino for p in folder.glob("__pycache__/*.pyc")} == compiled


def test_the_mode_is_a_setting() -> None:
    assert isinstance(GVisorBackend(mode="runsc").backend(), RunscBackend)
    assert GVisorBackend(mode="runsc", platform="kvm").platform == "kvm"


UNPRIVILEGED = """
from stockade import LimitNotEnforceable, Limits, Sandbox
from stockade.sandbox.gvisor import GVisorBackend, RunscBackend
gvisor = GVisorBackend(mode="docker")
try:
    Sandbox.create(backend=gvisor)
    raise SystemExit("created without inode limits and without consent")
except LimitNotEnforceable as err:
    assert err.setting == "inodes" and "allow_weaker" in err.fix, err
with Sandbox.create(backend=gvisor, allow_weaker=True, limits=Limits(memory_mb=128, disk_mb=16)) as sbx:
    assert any(w.startswith("inodes") for w in sbx.enforcement.weakened), sbx.enforcement
    r = sbx.commands.run("dd if=/dev/zero of=/workspace/f bs=1M count=40 2>&1; id -u")
    assert "No space left" in r.stdout and int(r.stdout.split()[-1]) >= 65536, r  # a uid of its own
    assert sbx.run_code("6 * 7").text == "42"
assert not RunscBackend().probe().available  # runsc without Docker needs root: it says so
print("ok")
"""


def test_without_root_gvisor_needs_consent_for_unlimited_inodes() -> None:
    """An unprivileged user (here: nobody, allowed to use the engine) cannot mount host
    tmpfs; gVisor's own tmpfs limits size but not inodes, so it takes allow_weaker=True."""
    require_tier("gvisor")
    if os.geteuid() != 0:
        pytest.skip("this test drops from root to an unprivileged user")
    src = Path(__file__).resolve().parents[2] / "src"
    site = Path(sysconfig.get_paths()["purelib"])
    engine_group = Path("/var/run/docker.sock").stat().st_gid
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", f"--groups={engine_group}"]
    if subprocess.run([*nobody, "test", "-r", str(src / "stockade" / "__init__.py")], check=False).returncode:
        pytest.skip("the checkout is not readable by an unprivileged user here")
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={src}:{site}", "HOME=/tmp"]
    out = subprocess.run(
        [*nobody, *env, "/usr/bin/python3", "-c", UNPRIVILEGED],
        check=False, capture_output=True, text=True, timeout=180, cwd="/tmp",
    )  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr


FLOOD_THE_SUPERVISORS_STDERR = r"""
import os
err = os.open("/proc/1/fd/2", os.O_WRONLY)
for _ in range(256):
    os.write(err, b"A" * (1 << 20))
print("written")
"""
# The supervisor's pipe to the host (its main() dups stdin, then stdout: 3 and 4): a prefix
# saying 128 MiB, then most of the body, never the frame's end.
FORGE_A_LARGE_FRAME = r"""
import os, struct, time
out = os.open("/proc/1/fd/4", os.O_WRONLY)
os.write(out, struct.pack(">II", 2, (128 << 20) - 1) + b"{}" + b"Z" * (100 << 20))
time.sleep(30)
"""


def test_code_writing_to_the_supervisors_descriptors_costs_the_host_nothing(direct: RunscBackend) -> None:
    """gVisor's /proc lets code open the supervisor's descriptors whatever its dumpable flag
    (found from outside): its stderr, runsc's, was a file on the host's disk that took 1 GB in
    0.74 s, counted nowhere; a frame's prefix saying 128 MiB made the host hold that much per
    sandbox for as long as the sandbox lived, waiting for the frame's end to check its seal.
    The log keeps its first 256 KiB; a forged prefix ends the sandbox at once."""
    from stockade.exceptions import SandboxCrashed
    from stockade.sandbox._gvisor_bundle import LOG_BYTES

    with Sandbox.create(backend=direct, limits=Limits(memory_mb=256, timeout_s=60)) as sbx:
        log = direct.state_dir / f"gv-{sbx.id}" / "runsc.log"
        sbx.files.write("flood.py", FLOOD_THE_SUPERVISORS_STDERR)
        assert sbx.commands.run("python3 flood.py", timeout_s=50).stdout == "written\n"
        assert sbx.run_code("1 + 1").text == "2"  # the sandbox goes on
        assert log.stat().st_size <= LOG_BYTES
    with Sandbox.create(backend=direct, limits=Limits(memory_mb=256, timeout_s=60)) as sbx:
        sbx.files.write("forge.py", FORGE_A_LARGE_FRAME)
        with pytest.raises(SandboxCrashed, match="wrote to the supervisor's channel"):
            sbx.commands.run("python3 forge.py", timeout_s=50)


# A command that looks for the interpreter's request and reply channels (its fds 3 and 4)
# where gVisor's /proc lets it open descriptors: the interpreter's own, and every one of the
# supervisor's that is a socket or the same pipe. What it could open, it could read a
# concurrent run's request from (its code, the sandbox's env) and answer in its place.
REACH_THE_INTERPRETERS_CHANNELS = r"""
import os, sys
interp = sys.argv[1]
channels = {os.readlink(f"/proc/{interp}/fd/{fd}") for fd in (3, 4)}
print(*sorted(target.split(":")[0] for target in channels))
paths = [f"/proc/{interp}/fd/{fd}" for fd in (3, 4)]
for fd in os.listdir("/proc/1/fd"):
    try:
        target = os.readlink(f"/proc/1/fd/{fd}")
    except OSError:
        continue
    if target in channels or target.startswith("socket:"):
        paths.append(f"/proc/1/fd/{fd}")
for path in paths:
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            os.close(os.open(path, flags | os.O_NONBLOCK))
            print("opened", path)
        except OSError:
            pass
"""


def test_commands_cannot_reach_the_interpreters_requests_and_replies() -> None:
    """On gVisor code opens any descriptor of the supervisor's through /proc/1/fd/N, a
    pipe's either end. The interpreter's requests and replies went through pipes: a command
    read a concurrent run's code and answered it with a forged result in 0.01 s, the real
    code never run (found from outside). They are unix socket pairs now, which no /proc
    path opens (ENXIO)."""
    require_tier("gvisor")
    with Sandbox.create("gvisor", limits=Limits(memory_mb=256, timeout_s=30)) as sbx:
        interp = sbx.run_code("import os; os.getpid()").text
        sbx.files.write("reach.py", REACH_THE_INTERPRETERS_CHANNELS)
        reach = sbx.commands.run(f"python3 reach.py {interp}")
        assert reach.exit_code == 0 and reach.stdout == "socket socket\n", reach
        assert sbx.run_code("6 * 7").text == "42"


# Fill the three writable places (171 MiB of memory-backed files), then hold ``{mb}`` MiB
# more in one process, touched page by page so that the host gives them.
FILES_THEN_A_HOG = (
    "head -c 115M /dev/urandom > /workspace/f && head -c 28M /dev/urandom > /tmp/f"
    " && head -c 28M /dev/urandom > /dev/shm/f"
    ' && python3 -c \'b = bytearray({mb} << 20); b[::4096] = b"x" * len(b[::4096]); print("held")\''
)


@pytest.mark.parametrize("mode", ["docker", "runsc"])
def test_files_and_processes_together_stay_within_memory_mb(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """The code's files and its processes share ``memory_mb``, as on Docker; gVisor's own
    kernel gets a measured allowance on top. Its host cgroup was ``memory_mb`` + 128 MiB:
    at 256 MiB, 171 MiB of files and a process holding 140 MiB more (347 MiB) lived. Now
    they pass it by at most the idle kernel's unused rest (about 16 MiB): 25 MiB is too much."""
    from stockade.exceptions import SandboxCrashed

    if mode == "docker":
        backend: Backend = GVisorBackend(mode="docker")
        require("gVisor under Docker", backend.probe().available)
    else:
        backend = request.getfixturevalue("direct")
    limits = Limits(memory_mb=256, disk_mb=120, tmp_mb=30, inodes=2048, timeout_s=60)
    with Sandbox.create(backend=backend, limits=limits) as sbx:
        host = sbx.enforcement.host
        assert host is not None
        assert host.memory_mb == limits.memory_mb + 32  # what the host holds, gVisor's kernel with it
        within = sbx.commands.run(FILES_THEN_A_HOG.format(mb=60))  # 231 MiB of 256
        assert within.stdout == "held\n", within
    with Sandbox.create(backend=backend, limits=limits) as sbx:
        try:
            past = sbx.commands.run(FILES_THEN_A_HOG.format(mb=110))  # 281 MiB of 256
        except SandboxCrashed as err:
            assert err.cause == "out_of_memory", err
        else:
            assert past.exit_code != 0 and "held" not in past.stdout, past


# Under a commands allowlist no file the code wrote may run (``_rules.written_noexec``). The
# probe copies a listed program into a written place and runs it three ways, printing each
# outcome: "ran", "exit N", "signal N", or the errno of an exec refused.
RUN_A_WRITTEN_COPY = r"""
import errno, os, shutil, subprocess, sys
copy = shutil.copy("/usr/bin/ls", sys.argv[1])
def outcome(rc):
    return "ran" if rc == 0 else f"signal {-rc}" if rc < 0 else f"exit {rc}"
try:
    print("subprocess", outcome(subprocess.run([copy, "/"], capture_output=True).returncode))
except OSError as err:
    print("subprocess", errno.errorcode[err.errno])
print("sh", outcome(subprocess.run(["sh", "-c", copy + " /"], capture_output=True).returncode))
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the copy would list
    try:
        os.execv(copy, [copy, "/"])
    except OSError as err:
        os.write(2, errno.errorcode[err.errno].encode())
        os._exit(126)
_, status = os.waitpid(pid, 0)
print("execv", outcome(os.waitstatus_to_exitcode(status)))
"""
LIMITS = Limits(memory_mb=256, timeout_s=20)
REFUSED = {"subprocess": "EACCES", "sh": "exit 126", "execv": "exit 126"}
RAN = {"subprocess": "ran", "sh": "ran", "execv": "ran"}
LISTED = SandboxRules(allow=("python3", "sh", "ls"))


def _gvisor(mode: str, request: pytest.FixtureRequest) -> Backend:
    if mode == "docker":
        backend: Backend = GVisorBackend(mode="docker")
        require("gVisor under Docker", backend.probe().available)
        return backend
    direct: RunscBackend = request.getfixturevalue("direct")
    return direct


def _run_written_copies(sbx: Sandbox) -> dict[str, dict[str, str]]:
    """Per written place, how each way of running a copy the code wrote there ended."""
    found = {}
    for place in ("/tmp", WORKSPACE, "/dev/shm"):
        r = sbx.commands.run(["python3", "-c", RUN_A_WRITTEN_COPY, f"{place}/copy"])
        assert r.exit_code == 0, r
        found[place] = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    return found


@pytest.mark.parametrize("mode", ["runsc", "docker"])
def test_under_an_allowlist_no_file_the_code_wrote_runs_its_exec_refused(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """The written places are noexec in gVisor's view: run by runsc, from the bundle; under
    Docker, whose binds carry no such option, once the supervisor's boot remounted them so in
    a view of its own (a dynamically linked copy faulted there before, on the host tmpfs's
    noexec). An exec of a file the code wrote is refused (EACCES, 126 from a shell) before
    anything of it runs. Without an allowlist it runs."""
    require_tier("gvisor")
    backend = _gvisor(mode, request)
    with Sandbox.create(backend=backend, limits=LIMITS, rules=LISTED, allow_weaker=True) as sbx:
        for place, outcomes in _run_written_copies(sbx).items():
            assert outcomes == REFUSED, place
    with Sandbox.create(backend=backend, limits=LIMITS) as sbx:
        for place, outcomes in _run_written_copies(sbx).items():
            assert outcomes == RAN, place


def _static_program() -> bytes:
    """A static x86-64 ELF of 159 bytes, made by hand: it writes PWNED and exits 0. It needs
    no loader and no library, and fits in one page."""
    code = (
        bytes.fromhex(
            "b801000000"  # mov eax, 1 (write)
            "bf01000000"  # mov edi, 1
            "488d3510000000"  # lea rsi, [rip + 16]: the message, after the code
            "ba06000000"  # mov edx, 6
            "0f05"  # syscall
            "b83c000000"  # mov eax, 60 (exit)
            "31ff"  # xor edi, edi
            "0f05"  # syscall
        )
        + b"PWNED\n"
    )
    base, entry = 0x400000, 64 + 56  # the code follows the ELF header and its one PT_LOAD
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 0x3E, 1, base + entry, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, entry + len(code), entry + len(code), 0x1000)
    return header + load + code


# The probe copies the static program into each written place and runs it from a fork,
# printing per place "ran" (it printed PWNED), "exit N", "signal N", or the errno refusing it.
RUN_A_WRITTEN_STATIC_PROGRAM = r"""
import errno, os, shutil
for place in ("/tmp", "/workspace", "/dev/shm"):
    copy = shutil.copy("/workspace/static", place + "/static-copy")
    os.chmod(copy, 0o755)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(write, 1)
        try:
            os.execv(copy, [copy])
        except OSError as err:
            os.write(2, errno.errorcode[err.errno].encode())
            os._exit(126)
    os.close(write)
    said = os.read(read, 64)
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(place, "ran" if said == b"PWNED\n" else f"signal {-rc}" if rc < 0 else f"exit {rc}")
"""


@pytest.mark.parametrize("mode", ["runsc", "docker"])
def test_under_an_allowlist_a_static_program_the_code_wrote_is_refused_as_enforcement_says(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """A static program faults on no host mapping: only the written places' noexec in gVisor's
    own view refuses it. Under Docker it ran (the engine's binds carry no noexec into that
    view) until the supervisor's boot remounted them so; now both modes refuse it, from
    commands and the interpreter alike, as ``enforcement.weakened`` says."""
    require_tier("gvisor")
    backend = _gvisor(mode, request)
    with Sandbox.create(backend=backend, limits=LIMITS, rules=LISTED, allow_weaker=True) as sbx:
        commands = next(said for said in sbx.enforcement.weakened if said.startswith("command rules"))
        assert "no program the code wrote runs" in commands, sbx.enforcement
        sbx.files.write("static", _static_program())
        command = sbx.commands.run(["python3", "-c", RUN_A_WRITTEN_STATIC_PROGRAM])
        code = sbx.run_code(RUN_A_WRITTEN_STATIC_PROGRAM)
        assert code.error is None, code
        for out in (command.stdout, code.logs.stdout):
            assert dict(line.split(" ", 1) for line in out.splitlines()) == {
                "/tmp": "exit 126",
                WORKSPACE: "exit 126",
                "/dev/shm": "exit 126",
            }, (command, code)


# Code trying to make a view of the written places without noexec: a user and mount namespace
# of its own (unshare, or clone with its flags), another's (setns), a remount, an unmount.
# Prints each call and the errno refusing it (or "made").
UNDO_NOEXEC = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS, MS_REMOUNT, MS_BIND, SIGCHLD = 0x10000000, 0x20000, 32, 4096, 17
own = os.open("/proc/self/ns/user", os.O_RDONLY)
for name, call in (
    ("unshare", lambda: libc.unshare(CLONE_NEWUSER | CLONE_NEWNS)),
    ("clone", lambda: libc.syscall(56, CLONE_NEWUSER | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0)),
    ("setns", lambda: libc.setns(own, 0)),
    ("mount", lambda: libc.mount(None, b"/tmp", None, MS_BIND | MS_REMOUNT, None)),
    ("umount2", lambda: libc.umount2(b"/tmp", 2)),
):
    made = call()
    if made == 0 and name == "clone":
        os._exit(0)  # the clone's child, had it been made
    print(name, "made" if made >= 0 else errno.errorcode[ctypes.get_errno()])
"""
REFUSED_CALLS = dict.fromkeys(("unshare", "clone", "setns", "mount", "umount2"), "EPERM")


@pytest.mark.parametrize("mode", ["runsc", "docker"])
def test_under_an_allowlist_code_cannot_make_a_view_where_what_it_wrote_runs(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """The noexec of the written places holds for every process: code can make no namespace
    (unshare, clone), join none (setns), and change no mount (mount, umount2), whether from
    Python or with ``unshare -Urm`` and a remount; the static program it wrote stays refused.
    It runs as the uid it would: the one owning the workspace the host made, and what it
    writes there comes back to the host."""
    require_tier("gvisor")
    backend = _gvisor(mode, request)
    rules = SandboxRules(allow=("python3", "sh", "unshare", "mount"))
    with Sandbox.create(backend=backend, limits=LIMITS, rules=rules, allow_weaker=True) as sbx:
        sbx.files.write("static", _static_program())
        command = sbx.commands.run(["python3", "-c", UNDO_NOEXEC])
        code = sbx.run_code(UNDO_NOEXEC)
        for out in (command.stdout, code.logs.stdout):
            assert dict(line.split(" ", 1) for line in out.splitlines()) == REFUSED_CALLS, (command, code)
        remount = sbx.commands.run("unshare -Urm sh -c 'mount -o remount,bind,exec /tmp && echo remounted'")
        assert remount.exit_code != 0 and "remounted" not in remount.stdout, remount
        ran = sbx.commands.run(["python3", "-c", RUN_A_WRITTEN_STATIC_PROGRAM])
        assert ran.stdout.count("exit 126") == 3, ran
        who = sbx.commands.run(["python3", "-c", "import os; print(os.getuid(), os.stat('.').st_uid)"])
        uid, owner = who.stdout.split()
        assert uid == owner, who
        sbx.commands.run(["python3", "-c", "open('/workspace/made', 'w').write('by code')"])
        assert sbx.files.read("made") == "by code"


@pytest.mark.parametrize("mode", ["docker", "runsc"])
def test_under_an_allowlist_a_library_the_code_wrote_never_runs(
    mode: str, written_library: bytes, request: pytest.FixtureRequest
) -> None:
    """gVisor's kernel maps a noexec mount's file executable when asked (LD_PRELOAD, dlopen,
    mmap with PROT_EXEC); the host tmpfs under it is noexec on both paths, so the host
    kernel refuses gVisor's own mapping and the program faults before the library's code runs."""
    require_tier("gvisor")
    backend = _gvisor(mode, request)
    with Sandbox.create(backend=backend, limits=LIMITS, rules=LISTED, allow_weaker=True) as sbx:
        sbx.files.write("x.so", written_library)
        sbx.commands.run('python3 -c \'import shutil; shutil.copy("/workspace/x.so", "/tmp/x.so")\'')
        for place in (WORKSPACE, "/tmp"):
            r = sbx.commands.run(f"LD_PRELOAD={place}/x.so ls /workspace; echo exit $?")
            assert "RAN-A-WRITTEN-LIBRARY" not in r.stdout, (place, r)
            assert r.stdout.splitlines()[-1] == "exit 139", (place, r)  # SIGSEGV


# A memfd is on no mount, so no noexec holds a program the code wrote into one. The probe
# writes a listed program into a memfd and runs it by the descriptor (fexecve: execveat) and
# by its /proc name, printing how each ended ("ran", "exit N", "signal N"), or the errno that
# refused the memfd; and whether memfd_secret made one.
RUN_FROM_A_MEMFD = r"""
import ctypes, errno, os
def run(route, exec_):
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the program would list
        try:
            exec_()
        finally:
            os._exit(126)
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(route, "ran" if rc == 0 else f"signal {-rc}" if rc < 0 else f"exit {rc}")
try:
    fd = os.memfd_create("program", 0)
except OSError as err:
    print("memfd_create", errno.errorcode[err.errno])
else:
    os.write(fd, open("/usr/bin/ls", "rb").read())
    run("fexecve", lambda: os.execve(fd, ["ls", "/"], {}))
    run("proc", lambda: os.execv(f"/proc/self/fd/{fd}", ["ls", "/"]))
made = ctypes.CDLL(None, use_errno=True).syscall(447, 0)  # memfd_secret
print("memfd_secret", "made" if made >= 0 else errno.errorcode[ctypes.get_errno()])
"""
MEMFDS_REFUSED = {"memfd_create": "EPERM", "memfd_secret": "EPERM"}


def _memfd_routes(sbx: Sandbox) -> dict[str, dict[str, str]]:
    """How the probe ended, run as a command and by the interpreter."""
    command = sbx.commands.run(["python3", "-c", RUN_FROM_A_MEMFD])
    assert command.exit_code == 0, command
    code = sbx.run_code(RUN_FROM_A_MEMFD)
    assert code.error is None, code
    return {
        route: dict(line.split(" ", 1) for line in out.splitlines())
        for route, out in (("command", command.stdout), ("run_code", code.logs.stdout))
    }


@pytest.mark.parametrize("mode", ["docker", "runsc"])
def test_under_an_allowlist_no_program_the_code_wrote_into_a_memfd_runs(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """gVisor's kernel has no exec listener to refuse memfds (as the other tiers' does): the
    supervisor's own filter fails memfd_create and memfd_secret (EPERM) for every process of
    the sandbox, commands and the interpreter alike, and a reset's fresh supervisor (its
    zygote gone) keeps it. Without an allowlist memfds are made, and what is in them runs."""
    require_tier("gvisor")
    backend = _gvisor(mode, request)
    with Sandbox.create(backend=backend, limits=LIMITS, rules=LISTED, allow_weaker=True) as sbx:
        assert any("memfd_create refused" in said for said in sbx.enforcement.weakened), sbx.enforcement
        assert _memfd_routes(sbx) == {"command": MEMFDS_REFUSED, "run_code": MEMFDS_REFUSED}
        zygote = sbx.run_code("import os, signal\nos.getppid()").text
        sbx.run_code("os.kill(os.getppid(), signal.SIGKILL)")
        sbx.reset()
        assert sbx.run_code("import os\nos.getppid()").text != zygote  # a fresh supervisor's
        assert _memfd_routes(sbx) == {"command": MEMFDS_REFUSED, "run_code": MEMFDS_REFUSED}
    with Sandbox.create(backend=backend, limits=LIMITS) as sbx:
        ran = {"fexecve": "ran", "proc": "ran", "memfd_secret": "ENOSYS"}
        assert _memfd_routes(sbx) == {"command": ran, "run_code": ran}
