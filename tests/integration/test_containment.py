"""Containment: hostile code stays in the sandbox. Every assertion is checked from the host.

Parametrised over every tier, like the conformance suite.
"""

from __future__ import annotations

import ast
import contextlib
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade import Limits, Sandbox, StockadeError, WorkspaceFull
from stockade.policy.prepare import prepare_policy
from stockade.sandbox import _registry
from stockade.types import NetworkPolicy, SandboxRules
from tests.conftest import host_processes, wait_for
from tests.integration.conftest import TIERS, KeptSandboxes, fork_bomb_limits

MiB = 1024 * 1024


# The containment that holds without a policy holds with one: the sandbox's own rules (execs
# judged, programs masked) change nothing of it.
POLICY = SandboxRules(deny=("curl", "wget", "nc", "ssh"), approve=("rm -r", "git push", "pip install"))


# And with a network allowlist: the egress proxy opens those hosts, over HTTP(S), and nothing else.
ALLOWLIST = NetworkPolicy(allow_hosts=("pypi.org", "files.pythonhosted.org", "*.github.com"))


@pytest.fixture(params=[None, POLICY, ALLOWLIST], ids=["no-policy", "policy", "allowlist"])
def sbx(tier: str, request: pytest.FixtureRequest, kept_sandboxes: KeptSandboxes) -> Iterator[Sandbox]:
    rules = request.param if isinstance(request.param, SandboxRules) else None
    network = request.param if isinstance(request.param, NetworkPolicy) else None
    with kept_sandboxes.acquire(tier, rules, network) as sandbox:  # a reset is in place: kept
        yield sandbox


def host_processes_with(marker: str) -> list[int]:
    return host_processes(marker.encode())


@pytest.fixture
def canary() -> Iterator[Path]:
    """A secret file on the host, outside anything a sandbox may see."""
    directory = Path("/var/tmp") / f"stockade-canary-{secrets.token_hex(4)}"
    directory.mkdir()
    path = directory / "secret.txt"
    path.write_text("CANARY-" + secrets.token_hex(8))
    yield path
    shutil.rmtree(directory)


def test_nothing_outside_the_workspace_is_writable(sbx: Sandbox) -> None:
    r = sbx.commands.run(
        "for d in /usr /etc /opt /bin /var /home /root /proc/sys /sys /dev; do "
        "  touch $d/stockade-probe 2>/dev/null && echo WROTE $d; done; echo done"
    )
    assert r.stdout.strip().endswith("done") and "WROTE" not in r.stdout
    assert not Path("/usr/stockade-probe").exists() and not Path("/etc/stockade-probe").exists()
    assert sbx.commands.run("touch /workspace/ok /tmp/ok && echo yes").stdout == "yes\n"


def test_a_host_file_cannot_be_read(sbx: Sandbox, canary: Path) -> None:
    secret = canary.read_text()
    r = sbx.commands.run(
        f"cat {canary}; ls {canary.parent}; "
        f"find / -path /proc -prune -o -path /sys -prune -o -name {canary.name} -print 2>/dev/null | head"
    )
    assert secret not in r.stdout and secret not in r.stderr
    assert canary.name not in r.stdout


def test_no_network_reaches_a_host_listener(sbx: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    call_ended: list[float] = []

    def accept() -> None:
        # Until a second after the code's connects have all ended (not a fixed 3 s, however
        # long they take): a connection made by then waits in the listener's queue, and one
        # forwarded late (by a relay, QEMU's user network) has that second to land.
        while True:
            try:
                accepted.append(server.accept())
            except TimeoutError:
                if call_ended and time.monotonic() > call_ended[0] + 1:
                    return

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        r = sbx.run_code(
            "import socket\n"
            "results = []\n"
            f"for host in ('127.0.0.1', '10.0.2.2', '172.17.0.1', '8.8.8.8'):\n"
            "    s = socket.socket(); s.settimeout(1)\n"
            f"    try: s.connect((host, {port})); results.append('CONNECTED ' + host)\n"
            "    except OSError as e: results.append(type(e).__name__)\n"
            "results"
        )
    finally:
        call_ended.append(time.monotonic())
        thread.join()
        server.close()
    assert r.error is None and "CONNECTED" not in (r.text or "")
    assert accepted == [], "the host listener saw a connection"


def test_host_unix_sockets_are_not_reachable(sbx: Sandbox) -> None:
    name = f"\0stockade-canary-{secrets.token_hex(4)}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)  # an abstract socket: only a shared network namespace can reach it
    server.listen()
    try:
        r = sbx.run_code(
            "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({name!r}); outcome = 'CONNECTED'\n"
            "except OSError as e:\n    outcome = type(e).__name__\noutcome"
        )
        assert r.text is not None and "CONNECTED" not in r.text
        listing = sbx.commands.run("ls /run /var/run 2>&1; ls -la /tmp").stdout
        assert "docker.sock" not in listing and ".X11-unix" not in listing
    finally:
        server.close()


def test_host_environment_does_not_leak(tier: str) -> None:
    secret = "HOSTSECRET-" + secrets.token_hex(8)
    os.environ["STOCKADE_TEST_HOST_SECRET"] = secret
    try:
        with Sandbox.create(tier, envs={"PASSED": "yes"}) as sbx:
            r = sbx.commands.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
            assert secret not in r.stdout
            assert "PASSED=yes" in r.stdout
    finally:
        del os.environ["STOCKADE_TEST_HOST_SECRET"]


def test_host_file_descriptors_do_not_leak(sbx: Sandbox, canary: Path) -> None:
    fd = os.open(canary, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        r = sbx.commands.run("for p in /proc/[0-9]*; do ls -l $p/fd 2>/dev/null; done")
        assert str(canary) not in r.stdout and "stockade-canary" not in r.stdout
    finally:
        os.close(fd)


def test_the_host_paths_are_not_visible(sbx: Sandbox) -> None:
    r = sbx.commands.run("pwd; cat /proc/self/mountinfo; ls /")
    assert r.stdout.startswith("/workspace\n")
    assert str(Path.cwd()) not in r.stdout
    # a name of its own: neither the host's nor one naming the sandbox or its container
    assert sbx.commands.run("cat /proc/sys/kernel/hostname").stdout == "sandbox\n"


def test_privileges_are_dropped(sbx: Sandbox) -> None:
    status = sbx.commands.run("cat /proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] != "0"
    assert int(fields["CapEff"].strip(), 16) == 0
    no_new_privs = sbx.commands.run(
        ["python3", "-c", "import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))"]
    )
    assert no_new_privs.stdout.strip() == "1"  # PR_GET_NO_NEW_PRIVS (gVisor has no status line)
    assert fields.get("Seccomp", "2").strip() == "2"


# Exits 1 (refused) only when the filter said no.
REFUSED = (
    'python3 -c "import ctypes, sys; l = ctypes.CDLL(None, use_errno=True); r = l.syscall({call}); '
    'sys.exit(1 if r < 0 and ctypes.get_errno() in (1, 38) else 0)"'
)


@pytest.mark.parametrize(
    "attempt",
    [
        "unshare -U true",
        "unshare -n true",
        "mount -t tmpfs none /tmp",
        'python3 -c "import ctypes; l=ctypes.CDLL(None); assert l.ptrace(0,0,0,0) == 0"',
        'python3 -c "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"',
        'python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)"',
        # by the error the filter gives (EPERM, ENOSYS): a call let through fails too on
        # arguments like these (EFAULT, EINVAL), which said nothing of the filter
        REFUSED.format(call="425, 8, 0"),  # io_uring_setup
        REFUSED.format(call="321, 0, 0, 0"),  # bpf
        REFUSED.format(call="250, 0, 0, 0"),  # keyctl
        REFUSED.format(call="206, 1, ctypes.byref(ctypes.c_ulong(0))"),  # io_setup
        REFUSED.format(call="298, 0, 0, -1, -1, 0"),  # perf_event_open
        REFUSED.format(call="323, 0"),  # userfaultfd
    ],
)
def test_kernel_surface_is_refused(sbx: Sandbox, attempt: str) -> None:
    r = sbx.commands.run(attempt)
    assert r.exit_code != 0, f"{attempt!r} succeeded: {r.stdout} {r.stderr}"


# Code runs as the supervisor's uid, which is all the kernel asks of a call that sets another
# process's limits or scheduling: on the sandbox's pid 1 (the supervisor), RLIMIT_CPU (1, 1)
# was the kernel's own SIGKILL (at once on a microVM, whose supervisor had used its second),
# RLIMIT_AS its death at its next allocation, SCHED_IDLE or nice 19 its starvation. Each
# attempt says whether it was refused (EPERM) or done.
ON_OTHERS = r"""
import ctypes, os, resource
libc = ctypes.CDLL(None, use_errno=True)

def ioprio_set(which, who, value):
    if libc.syscall(251, which, who, value) != 0:  # ioprio_set: no wrapper in glibc
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

attempts = {
    "RLIMIT_CPU of pid 1": lambda: resource.prlimit(1, resource.RLIMIT_CPU, (1, 1)),
    "RLIMIT_AS of pid 1": lambda: resource.prlimit(1, resource.RLIMIT_AS, (1 << 20, 1 << 20)),
    "RLIMIT_NOFILE of the zygote": lambda: resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3)),
    "nice of pid 1": lambda: os.setpriority(os.PRIO_PROCESS, 1, 19),
    "nice of every process of the uid": lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19),
    "CPU affinity of pid 1": lambda: os.sched_setaffinity(1, {min(os.sched_getaffinity(1))}),
    "SCHED_IDLE on pid 1": lambda: os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0)),
    "idle I/O class on pid 1": lambda: ioprio_set(1, 1, 3 << 13),
    "a write to /proc/1/limits": lambda: open("/proc/1/limits", "w").write("Max cpu time 1 1"),
}
outcome = {}
for what, attempt in attempts.items():
    try:
        attempt()
        outcome[what] = "done"
    except PermissionError:
        outcome[what] = "refused"
outcome
"""
# What code may still do to itself: glibc's setrlimit and nice, and Python's, name it as 0.
# The supervisor's own limit is not the code's (it holds the relay's descriptors too): it is
# left as it was.
ON_ITSELF = r"""
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
supervisor = resource.prlimit(1, resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft // 2, hard))
resource.setrlimit(resource.RLIMIT_CPU, (3600, 3600))
os.nice(1)
os.sched_setaffinity(0, os.sched_getaffinity(0))
(resource.getrlimit(resource.RLIMIT_NOFILE) == (soft // 2, hard), resource.getrlimit(resource.RLIMIT_CPU),
 resource.prlimit(1, resource.RLIMIT_NOFILE) == supervisor)
"""


def test_code_cannot_set_the_limits_or_scheduling_of_the_supervisor(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30)) as sbx:
        result = sbx.run_code(ON_OTHERS)
        assert result.error is None, result.error
        outcome = ast.literal_eval(result.text or "")
        assert outcome == dict.fromkeys(outcome, "refused")
        assert sbx.run_code("sum(range(10**7))").text == "49999995000000", "the supervisor lives on"
        sbx.files.write("still.txt", "here")
        assert sbx.commands.run("cat still.txt").stdout == "here"
        own = sbx.run_code(ON_ITSELF)
        assert own.error is None, own.error
        assert own.text == "(True, (3600, 3600), True)", "its own limits are code's to set"


# Alone: beside another worker's tests, gVisor's supervisor once reported the bomb's timeout past
# the grace (CI, 2026-12-02) and the host took the sandbox down whole (contained, but not what
# this test checks); gVisor's close after a bomb also takes up to 30 s on this machine at times.
@pytest.mark.alone
def test_a_fork_bomb_is_contained(tier: str) -> None:
    bomb = f"bomb{secrets.token_hex(4)}"  # on the command line of every fork: findable on the host
    with Sandbox.create(tier, limits=Limits(pids=64, timeout_s=5)) as sbx:
        r = sbx.commands.run(f"{bomb}() {{ {bomb} | {bomb} & }}; {bomb}; sleep 3", timeout_s=4)
        # the pids limit refused forks ("Cannot fork"), or the timeout took the tree down
        assert "cannot fork" in r.stderr.lower() or r.timed_out, r
        after = sbx.commands.run("ps -e --no-headers 2>/dev/null | wc -l; echo alive")
        assert after.stdout.strip().endswith("alive"), "the sandbox survives its fork bomb"
    wait_for(lambda: not host_processes_with(bomb), what="the bomb to die with its sandbox")


# Every process of this bomb leaves its parent's session and writes nowhere: neither the
# call's process group nor its pipes hold it, and each one's children are adopted by the
# supervisor as their parent dies. Alone for the reason above.
@pytest.mark.alone
def test_a_fork_bomb_that_leaves_its_session_dies_with_its_call(tier: str) -> None:
    marker = f"bomb{secrets.token_hex(4)}"  # on every fork's command line
    bomb = "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
    bomb += "    except OSError:\n        pass\n"
    with Sandbox.create(tier, limits=fork_bomb_limits(tier)) as sbx:
        sbx.files.write("bomb.py", bomb)
        r = sbx.commands.run(f"python3 bomb.py {marker} >/dev/null 2>&1 </dev/null & sleep 30", timeout_s=2)
        assert r.timed_out
        if sbx.alive:
            left = sbx.commands.run("ps -eo stat,args 2>/dev/null || cat /proc/[0-9]*/cmdline").stdout
            assert marker not in left, "the bomb outlived its call"
        # else the supervisor, sweeping the bomb on a loaded host (gVisor's scans of /proc
        # beside it take seconds), missed its grace and the host took the whole sandbox down
        # with the call (run 79, 7.6 s for a 2 s timeout): the bomb died with it all the same
        assert host_processes_with(marker) == []


def test_a_memory_bomb_is_killed_and_reported(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(memory_mb=128)) as sbx:
        r = sbx.commands.run("python3 -c \"x = bytearray(1024 * 1024 * 1024); print('allocated')\"")
        assert "allocated" not in r.stdout
        assert r.oom_killed or "MemoryError" in r.stderr
        ex = sbx.run_code("blocks = []\nwhile True: blocks.append(bytearray(16 * 1024 * 1024))")
        assert ex.error is not None and ex.error.name in ("MemoryLimitExceeded", "MemoryError", "KernelDied")
        assert sbx.run_code("1 + 1").text == "2", "the interpreter comes back"


# A process's address space is limited to memory_mb on gVisor and the microVM (RLIMIT_AS: one
# hog gets a MemoryError): a child holds 96 MiB, then its parent, the command, grows past it
# until the memory limit kills the larger, the parent.
TWO_HOGS = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    held = b'x' * (96 << 20)
    os.write(w, b'.')
    time.sleep(600)
os.read(r, 1)
blocks = []
while True:
    blocks.append(b'x' * (8 << 20))
"""

ONE_HOG = """
blocks = []
while True:
    blocks.append(b'x' * (8 << 20))
"""


def test_only_the_call_whose_process_the_memory_limit_killed_says_so(tier: str) -> None:
    """The sandbox counts its OOM kills, not each call's: a command and a run waiting beside a
    hog while it was killed once both came back ``oom_killed`` (the run: untouched), exit 0
    and all their output notwithstanding."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=60)) as sbx:
        wait = "while [ ! -e hog-done ]; do sleep 0.05; done"
        ended: dict[str, Any] = {}
        beside = [
            threading.Thread(
                target=lambda: ended.update(command=sbx.commands.run(f"touch cmd-up; {wait}; echo innocent"))
            ),
            threading.Thread(
                target=lambda: ended.update(
                    code=sbx.run_code(
                        "import os, time\nopen('code-up', 'w').close()\n"
                        "while not os.path.exists('hog-done'): time.sleep(0.05)\nprint('innocent')"
                    )
                )
            ),
        ]
        for thread in beside:
            thread.start()
        wait_for(lambda: sbx.files.exists("cmd-up") and sbx.files.exists("code-up"), what="both waiting")
        if tier == "gvisor":
            # Its kernel is a host process: the limit, when hit, kills the whole sandbox. Two
            # hogs (96 MiB + memory_mb) and the waiting interpreter reach it under load; one
            # hog under a smaller address space is a MemoryError and leaves the rest room.
            hog = sbx.commands.run(["sh", "-c", 'ulimit -v 163840 && exec python3 -c "$1"', "sh", ONE_HOG])
        else:
            hog = sbx.commands.run(["python3", "-c", TWO_HOGS])
        sbx.files.write("hog-done", b"")
        for thread in beside:
            thread.join()
        if tier == "gvisor":
            assert hog.exit_code == 1 and not hog.oom_killed and "MemoryError" in hog.stderr, hog
        else:
            assert hog.oom_killed and hog.exit_code == 137, hog
        command = ended["command"]
        assert (command.exit_code, command.stdout, command.oom_killed) == (0, "innocent\n", False), command
        code = ended["code"]
        assert code.error is None and code.logs.stdout == "innocent\n", code


# Fills its memory to 48 MiB under the limit, then reads its system's files (twice that room,
# dropped from the page cache first, so that their pages are the sandbox's) over and over: the
# kernel evicts them, the program reads them back, and the OOM killer never runs. Files of at
# most 16 MiB under /usr/lib and /usr/share: not the host's programs (the process tier's /usr is
# the host's), nor one huge file for the whole thrash.
THRASH = """
import os
room = 48 << 20
chosen, total = [], 0
tops = ("/usr/lib", "/usr/share")
paths = (os.path.join(root, name) for top in tops for root, _, names in os.walk(top) for name in names)
for path in paths:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        continue
    if st.st_mode & 0o170000 == 0o100000 and 1 << 16 <= st.st_size <= 16 << 20:
        chosen.append(path)
        total += st.st_size
        if total >= 2 * room:
            break
for path in chosen:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
hold = b"x" * (LIMIT - room)
print("reading", total >> 20, "MiB", flush=True)
while True:
    for path in chosen:
        with open(path, "rb") as fh:
            while fh.read(1 << 20):
                pass
"""


# The tiers whose memory cgroup is on this host's kernel, watched by the host. gVisor caches
# the files its programs read in its own memory: this thrash does not happen there. The
# microVM's guest re-reads them from the host's page cache: 18,000 refaults a second cost it
# 8% of its time (its pressure stall), progress, not a stall; it is not watched.
@pytest.mark.parametrize("tier", [t for t in TIERS if t in ("process", "docker")], indirect=True)
@pytest.mark.alone  # seconds of the host's disk at full speed: other tests' deadlines would pay
def test_thrashing_at_the_memory_limit_is_killed_for_memory_not_left_to_its_timeout(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=60)) as sbx:
        ex = sbx.run_code(f"LIMIT = {256 * MiB}\n" + THRASH)
        assert "reading" in ex.logs.stdout, ex  # the kernel's own OOM kill came first: no thrash
        assert ex.error is not None and ex.error.name == "MemoryLimitExceeded", ex.error
        assert not ex.timed_out
        assert sbx.run_code("1 + 1").text == "2", "the interpreter comes back"
        # A command is judged the same way, and says so as the kernel's kill would.
        sbx.files.write("thrash.py", f"LIMIT = {256 * MiB}\n" + THRASH)
        r = sbx.commands.run("python3 thrash.py")
        assert "reading" in r.stdout and r.oom_killed and not r.timed_out, r


def test_an_output_flood_is_capped(tier: str) -> None:
    # 2 MiB, 32x the cap: the command runs to its end past the cap, every byte counted, one kept
    # in 32. (An endless `yes` for 2 s gave 4 MiB on a busy host's microVM, and took 4 s.)
    with Sandbox.create(tier, limits=Limits(output_bytes=64 * 1024)) as sbx:
        r = sbx.commands.run("yes flood | head -c 2M", timeout_s=10)
        assert r.exit_code == 0 and r.truncated and r.stdout_bytes == 2 * MiB
        assert len(r.stdout) < 64 * 1024 + 200
        # 1 MB, 15x the cap, in a thousand prints of 1/64 of it: the cap counts across writes
        # (10 MB in 10**5 prints took 30 s on the microVM; 1 MB in those prints, 16 s)
        ex = sbx.run_code("for _ in range(1000): print('x' * 1000)")
        assert ex.truncated and len(ex.logs.stdout) < 64 * 1024 + 200


def test_a_double_forked_process_dies_with_its_command(sbx: Sandbox) -> None:
    marker = f"{secrets.randbelow(10**6) + 1000}.25"
    r = sbx.commands.run(
        f"(setsid sleep {marker} &) ; (nohup sleep {marker} &) ; sleep {marker}", timeout_s=1
    )
    assert r.timed_out
    assert host_processes_with(f"sleep\0{marker}") == []
    assert marker not in sbx.commands.run("ps -eo args 2>/dev/null || cat /proc/[0-9]*/cmdline").stdout


def test_background_processes_die_when_the_command_exits(sbx: Sandbox) -> None:
    marker = f"{secrets.randbelow(10**6) + 1000}.5"
    r = sbx.commands.run(f"(sleep {marker} &) ; echo left one behind")
    assert r.exit_code == 0 and not r.timed_out and r.duration_s < 5
    assert host_processes_with(f"sleep\0{marker}") == []


def test_closing_leaves_no_process_behind(tier: str) -> None:
    marker = f"{secrets.randbelow(10**6) + 1000}.75"
    with Sandbox.create(tier) as sbx:
        # Closed while a command runs (a run_code call's processes end with the call anyway).
        runner = threading.Thread(target=_run_until_closed, args=(sbx, ["sleep", marker]))
        runner.start()
        if tier not in ("gvisor", "microvm"):  # their processes are not the host's
            wait_for(
                lambda: host_processes_with(f"sleep\0{marker}"), what="the sleep on the host", timeout_s=5
            )
        else:
            time.sleep(1)
    runner.join(timeout=30)
    assert not runner.is_alive()
    assert host_processes_with(f"sleep\0{marker}") == []


def _run_until_closed(sbx: Sandbox, argv: list[str]) -> None:
    with contextlib.suppress(StockadeError):
        sbx.commands.run(argv)


def host_disk_free() -> int:
    """Free bytes on the host's disk, the snapshot store's files counted as free: a microVM of a
    new shape builds its boot and ready images there (the guest's RAM), in the background after
    a start, bounded by the store's own limit; that is the store's growth, not the sandbox's."""
    free = shutil.disk_usage("/").free
    store = Path(os.environ.get("STOCKADE_SNAPSHOT_DIR", "/nonexistent"))
    if not store.is_dir() or store.stat().st_dev != Path("/").stat().st_dev:
        return free
    for folder, _, files in os.walk(store):
        for name in files:
            with contextlib.suppress(OSError):  # a temporary file renamed meanwhile
                free += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return free


FILL_LIMITS = Limits(disk_mb=32, tmp_mb=16)


@pytest.fixture
def fill_limits_built(tier: str) -> Limits:
    """What a start of a new shape builds in the background (the microVM's ready image, tens of
    MiB moving through the snapshot store) built before the test, so none of it moves while
    measured; and before its `alone` lock: the microVM's machine of its own is a cold boot and a
    ready image (11-13 s under TCG) that the other workers need not wait for."""
    prepare_policy(_registry.backend(tier), None, limits=FILL_LIMITS)
    return FILL_LIMITS


# Alone: the host's free disk; a test of another worker writes files meanwhile.
@pytest.mark.alone(before="fill_limits_built")
def test_filling_the_workspace_fails_inside_and_spares_the_host(tier: str, fill_limits_built: Limits) -> None:
    limits = fill_limits_built
    with Sandbox.create(tier, limits=limits) as sbx:
        before = host_disk_free()
        r = sbx.commands.run("dd if=/dev/zero of=/workspace/fill bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left" in r.stdout
        r = sbx.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M count=100 2>&1")
        assert "No space left" in r.stdout
        with pytest.raises(WorkspaceFull):
            sbx.files.write("more.bin", b"\0" * (40 * MiB))
        sbx.commands.run("rm -f /workspace/fill")
        assert sbx.commands.run("echo usable > /workspace/ok && cat /workspace/ok").stdout == "usable\n"
    assert abs(host_disk_free() - before) < 24 * MiB


def test_inodes_are_limited(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(inodes=2000)) as sbx:
        r = sbx.run_code(
            "import os\nn = 0\ntry:\n    for n in range(100000): open(f'/workspace/f{n}', 'w').close()\n"
            "except OSError as e: print(type(e).__name__, e.errno)\nn"
        )
        assert int(r.text or 0) < 5000 and "OSError" in r.logs.stdout


FILL_BYTES_THEN_FILES = """
import errno, os
stopped = {}
for place, count in %r.items():
    with open(f"{place}/bytes", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(bytes(1 << 20))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    made, why = 0, None
    try:
        for made in range(count + 64):  # the longest names: each file's most kernel memory
            os.close(os.open(f"{place}/{made:07d}" + "n" * 248, os.O_CREAT | os.O_WRONLY))
    except OSError as e:
        why = errno.errorcode[e.errno]
    stopped[place] = (made, why)
stopped
"""


@pytest.mark.parametrize("tier", [t for t in TIERS if t in ("process", "docker", "gvisor")], indirect=True)
def test_places_full_of_bytes_and_files_are_enospc_and_the_sandbox_lives_on(tier: str) -> None:
    # Empty files take nothing a size limit counts, but up to 3 KiB of kernel memory each.
    # The default counts were 65,536 files in the workspace and 16,384 in /tmp and /dev/shm
    # each, whatever memory_mb: at 64 MiB the filler was killed for memory, then every command,
    # and reset() found the sandbox dead (gVisor's ended whole). They are now sized from
    # memory_mb, so that full places leave the processes a quarter of it.
    limits = Limits(memory_mb=64, timeout_s=120)
    counts = {
        "/workspace": limits.workspace_inodes,
        "/tmp": limits.scratch_inodes,
        "/dev/shm": limits.scratch_inodes,
    }
    with Sandbox.create(tier, limits=limits) as sbx:
        r = sbx.run_code(FILL_BYTES_THEN_FILES % counts)
        assert r.error is None, r.error
        for place, (made, stopped) in ast.literal_eval(r.text or "").items():
            assert stopped == "ENOSPC" and counts[place] - 16 <= made < counts[place], (place, made, stopped)
        assert sbx.commands.run("echo usable").stdout == "usable\n"
        sbx.reset()
        after = sbx.commands.run(
            "find /workspace /dev/shm -mindepth 1 | wc -l; python3 -c 'print(len(bytearray(8 << 20)))'"
        )
        assert after.stdout.split() == ["0", str(8 << 20)], after


def test_posix_shared_memory_and_queues_work(sbx: Sandbox) -> None:
    r = sbx.run_code(
        "from multiprocessing import Process, Queue, shared_memory\n"
        "made = shared_memory.SharedMemory(create=True, size=1 << 20)\nmade.buf[:5] = b'hello'\n"
        "seen = shared_memory.SharedMemory(name=made.name)\ngot = bytes(seen.buf[:5])\n"
        "seen.close(); made.close(); made.unlink()\n"
        "q = Queue()\np = Process(target=q.put, args=(42,)); p.start()\n"
        "answer = q.get(timeout=10); p.join()\n(got, answer)"
    )
    assert r.error is None, r.error
    assert r.text == "(b'hello', 42)"


def test_a_process_gets_threads_by_its_memory_not_by_malloc_arenas(sbx: Sandbox) -> None:
    """On gVisor and the microVM RLIMIT_AS is memory_mb a process, and glibc's malloc arena for
    each thread reserves 64 MiB of it: a process got about a dozen threads whatever memory_mb
    (12 at 512 MB; ThreadPoolExecutor(16) failed). With one arena, in run_code's interpreter as
    in a command, a thread costs its 8 MiB stack: 16 fit in these sandboxes' 256 MB easily."""
    wide = (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "meet = threading.Barrier(16)\n"
        "with ThreadPoolExecutor(16) as pool:\n"
        "    print(len(list(pool.map(lambda _: meet.wait(10), range(16)))))\n"
    )
    r = sbx.run_code(wide)
    assert r.error is None, r.error
    assert r.logs.stdout == "16\n"
    sbx.files.write("wide.py", wide)
    done = sbx.commands.run("python3 wide.py", timeout_s=60)
    assert (done.exit_code, done.stdout) == (0, "16\n"), done.stderr[-2000:]


def test_large_writes_round_trip_and_the_sandbox_stays_usable(sbx: Sandbox) -> None:
    data = os.urandom(90 * MiB)  # of the 96 MiB workspace of a 256 MiB sandbox
    sbx.files.write("big.bin", data)
    assert sbx.files.read("big.bin", format="bytes") == data
    assert sbx.commands.run("stat -c %s big.bin").stdout.strip() == str(len(data))


def engine_container(sbx: Sandbox) -> dict[str, Any] | None:
    """The engine's view of a container tier's sandbox; None when no engine runs it."""
    import docker

    client = docker.from_env(version="auto")
    try:
        found = client.api.containers(all=True, filters={"label": f"stockade.id={sbx.id}"})
        return client.api.inspect_container(found[0]["Id"]) if found else None
    finally:
        client.close()


@pytest.mark.parametrize("tier", [t for t in TIERS if t in ("docker", "gvisor")], indirect=True)
def test_sandbox_traffic_never_lands_on_the_engines_disk(tier: str) -> None:
    # The protocol runs over the container's stdio: with a log driver, the engine wrote every
    # byte of it to a log file on the host (8 MiB read three times grew it by 94 MiB).
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30)) as sbx:
        info = engine_container(sbx)
        if info is None:
            return  # gVisor without an engine: the stream is our own pipes, nothing logs it
        log = Path(info["LogPath"]) if info["LogPath"] else None
        size = log.stat().st_size if log is not None and log.exists() else 0
        sbx.commands.run("head -c 8M /dev/urandom > big.bin")
        for _ in range(3):
            assert len(sbx.files.read("big.bin", format="bytes")) == 8 * MiB
        sbx.run_code("print('x' * 1_000_000)")
        grown = (log.stat().st_size if log is not None and log.exists() else 0) - size
        assert grown == 0, f"the engine logged {grown} bytes of the sandbox's traffic"
        assert info["HostConfig"]["LogConfig"]["Type"] == "none"
