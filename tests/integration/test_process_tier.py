"""What only the process tier does: its host resources, its failure modes, its settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stockade import LimitNotEnforceable, NetworkPolicy, Sandbox, SandboxCrashed
from stockade.sandbox import _cgroups
from stockade.sandbox.process import ProcessBackend, collect_garbage
from stockade.types import Mechanism
from tests.conftest import processes_of_uid, require, require_tier, wait_for


@pytest.fixture(autouse=True)
def _process_tier() -> None:
    require_tier("process")


class Trace:
    """A process sandbox's host processes, found by its host uid (one per sandbox as root)."""

    def __init__(self, sid: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("as another user, sandboxes share that user's uid: their processes look alike")
        self.uid = os.stat(Path("/run/stockade") / sid).st_uid
        assert self.uid != 0

    def processes(self) -> list[int]:
        return processes_of_uid(self.uid)


def pid_in_sandbox(pid: int) -> int | None:
    """``pid``'s number in its sandbox's pid namespace (1: the supervisor); None outside one."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            numbers = line.split()[1:]
            return int(numbers[-1]) if len(numbers) > 1 else None
    return None


def from_template(sbx: Sandbox) -> bool:
    """Whether the sandbox's supervisor is a fork of its backend's template."""
    from stockade.sandbox._template import Init

    return isinstance(sbx.instance.boundary.proc, Init)  # type: ignore[attr-defined]


def mounts_of(fragment: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if fragment in line]


def test_limits_are_enforced_by_cgroups_and_reported() -> None:
    with Sandbox.create() as sbx:
        e = sbx.enforcement
        assert e.memory in (Mechanism.CGROUP_V1, Mechanism.CGROUP_V2)
        assert e.pids == e.memory and e.disk is Mechanism.TMPFS and e.network is Mechanism.NAMESPACE
        assert e.weakened == ()


def test_a_sandbox_killed_from_outside_is_reported() -> None:
    sbx = Sandbox.create()
    boundary = sbx.instance.boundary  # type: ignore[attr-defined]
    os.kill(boundary.proc.pid, signal.SIGKILL)
    boundary.proc.wait(timeout=10)
    with pytest.raises(SandboxCrashed) as crashed:
        sbx.commands.run("true")
    assert crashed.value.cause == "killed"
    assert not sbx.alive
    sbx.close()


def test_a_sandbox_killed_under_a_call_says_so_and_keeps_its_output() -> None:
    with Sandbox.create() as sbx:
        boundary = sbx.instance.boundary  # type: ignore[attr-defined]
        threading.Timer(1.5, os.kill, (boundary.proc.pid, signal.SIGKILL)).start()
        with pytest.raises(SandboxCrashed) as crashed:
            sbx.commands.run("echo working on it; sleep 30")
    assert crashed.value.cause == "killed" and crashed.value.stdout == "working on it\n"
    assert "cause: killed" in crashed.value.report() and "working on it" in crashed.value.report()


def test_an_allowlist_goes_through_the_proxy_and_host_network_needs_consent() -> None:
    allowlist = NetworkPolicy(enabled=True, allow_hosts=("example.org",))
    with Sandbox.create(network=allowlist) as sbx:  # the egress proxy: tests/integration/test_egress.py
        assert sbx.enforcement.network is Mechanism.PROXY and not sbx.enforcement.weakened
    # Where the whole network cannot be walled (here: sandboxes pinned to one host uid, which
    # the walls cannot tell apart; tests/integration/test_process_full_network.py has the walls)
    unwalled = ProcessBackend(host_uid=65534) if os.geteuid() == 0 else ProcessBackend()
    with pytest.raises(LimitNotEnforceable):
        Sandbox.create(backend=unwalled, network=NetworkPolicy(enabled=True))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        with Sandbox.create(backend=unwalled, network=NetworkPolicy(enabled=True), allow_weaker=True) as sbx:
            # says what the host's stack shares: what listens on its loopback, its abstract sockets
            assert any("loopback" in w and "abstract" in w for w in sbx.enforcement.weakened)
            r = sbx.run_code(f"import socket; socket.create_connection(('127.0.0.1', {port})).close(); 'ok'")
            assert r.text == "'ok'"
    finally:
        server.close()


def test_create_close_cycles_leave_nothing_behind() -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    traces = []
    for _ in range(50):
        with Sandbox.create() as sbx:
            sbx.commands.run("true")
            traces.append((sbx.id, Trace(sbx.id)))
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    # Only ours: other sandboxes on a shared host come and go meanwhile.
    ours = {sid.removeprefix("sbx-") for sid, _ in traces}
    assert [g for g in _cgroups.leftover_groups() if any(i in g for i in ours)] == []
    for sid, trace in traces:
        assert mounts_of(sid) == [] and trace.processes() == []


def test_a_closed_sandbox_leaves_no_zombie_for_the_hosts_init() -> None:
    # Its supervisor (the pid namespace's init) is reaped by bwrap, not orphaned to the host's
    # init: under an init that reaps nothing (many containers) each close would leave one for
    # good. Looked at at once: this host's init takes seconds to reap what it is left.
    for _ in range(3):
        with Sandbox.create() as sbx:
            trace = Trace(sbx.id)
            sbx.run_code("import subprocess; subprocess.Popen(['sleep', '30'])")
            sbx.commands.run("sleep 30 &")
        assert zombies_of(trace.uid) == []


def zombies_of(uid: int) -> list[str]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                    if stat.rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                        found.append(stat.decode(errors="replace"))
            except OSError:
                continue  # gone meanwhile
    return found


def test_a_crashed_creator_leaves_garbage_that_gc_removes() -> None:
    code = (
        "import os, signal\n"
        "from stockade import Sandbox\n"
        "sbx = Sandbox.create()\n"
        "print(sbx.id, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    sid = out.stdout.strip()
    assert sid.startswith("sbx-")
    trace = Trace(sid)
    wait_for(lambda: not trace.processes(), what="bwrap to die with its parent")
    removed = collect_garbage()
    # by this collection, or by the one another process's first sandbox ran meanwhile (a test
    # of another worker: run 85 failed on this): either way, nothing of it is left
    assert any(sid in r for r in removed) or not (Path("/run/stockade") / sid).exists()
    assert mounts_of(sid) == [] and sid not in _cgroups.leftover_groups()


def test_gc_of_another_state_folder_spares_a_live_sandbox(tmp_path: Path) -> None:
    # A service and a script on one host, each with its own state folder: neither's gc may
    # take the other's sandboxes for garbage (before, it killed every group it had no folder for).
    with Sandbox.create() as sbx:
        removed = collect_garbage(tmp_path / "another-state-folder")
        assert not any(sbx.id in line for line in removed), removed
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert sbx.id in _cgroups.leftover_groups()


UNPRIVILEGED = """
from stockade import LimitNotEnforceable, Limits, Sandbox
try:
    Sandbox.create()
    raise SystemExit("created without cgroups and without consent")
except LimitNotEnforceable as err:
    assert "allow_weaker" in err.fix
with Sandbox.create(allow_weaker=True, limits=Limits(memory_mb=128, disk_mb=16)) as sbx:
    assert sbx.enforcement.memory.value == "rlimit" and sbx.enforcement.weakened
    r = sbx.commands.run("dd if=/dev/zero of=/workspace/f bs=1M count=40 2>&1")
    assert "No space left" in r.stdout, r
    r = sbx.commands.run("python3 -c 'x = bytearray(512 * 1024 * 1024)'")
    assert "MemoryError" in r.stderr, r
    assert sbx.run_code("6 * 7").text == "42"
print("ok")
"""


def test_without_root_weaker_limits_need_consent_and_still_hold() -> None:
    if os.geteuid() != 0:
        pytest.skip("this test drops from root to an unprivileged user")
    src = Path(__file__).resolve().parents[2] / "src"
    site = (
        Path(sys.prefix)
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
    )
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    if subprocess.run([*nobody, "test", "-r", str(src / "stockade" / "__init__.py")], check=False).returncode:
        pytest.skip("the checkout is not readable by an unprivileged user here")
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={src}:{site}"]
    out = subprocess.run(
        [*nobody, *env, "/usr/bin/python3", "-c", UNPRIVILEGED],
        check=False, capture_output=True, text=True, timeout=120, cwd="/tmp",
    )  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr


@pytest.fixture(
    params=[("launcher", "template"), ("shell", "template"), ("launcher", "exec"), ("shell", "exec")],
    ids="-".join,
)
def start_chain(request: pytest.FixtureRequest) -> ProcessBackend:
    """The two ways into a sandbox's cgroups and host uid: the compiled launcher (where the
    host builds it, as here), and the shell and nsenter (a host without a compiler); each
    with the supervisor forked from the template (as root, the default) or exec'd by bwrap."""
    from stockade.sandbox import _launch

    chain, start = request.param
    if chain == "launcher":
        require("the process tier's launcher (a C compiler, x86_64)", _launch.usable() is not None)
    return ProcessBackend(launcher=chain == "launcher", start=start)


def test_every_process_of_a_sandbox_is_in_each_of_its_cgroups(start_chain: ProcessBackend) -> None:
    # The launcher (or the shell) joins them before bwrap runs, moving its one thread on
    # cgroup v1: the sandbox's first process and all it started count against every limit.
    with Sandbox.create(backend=start_chain) as sbx:
        trace = Trace(sbx.id)
        sbx.run_code("print(1)")
        sbx.commands.run("sleep 0.01")
        boundary = sbx.instance.boundary  # type: ignore[attr-defined]
        assert boundary.cgroup is not None
        processes = set(trace.processes())
        assert from_template(sbx) == (start_chain.start_mode == "template")
        # bwrap (or, from the template, pid 1's keeper), pid 1, the zygote, the interpreter
        assert boundary.proc.pid in processes and len(processes) >= 4
        for folder in boundary.cgroup.dirs:
            members = {int(pid) for pid in (folder / "cgroup.procs").read_text().split()}
            assert processes <= members, folder


def test_every_process_of_a_sandbox_has_its_uid_and_gid_alone_and_no_groups(
    start_chain: ProcessBackend,
) -> None:
    # Real, effective, saved and filesystem ids: nothing in the chain that drops them may keep
    # root in one of them, nor the host's supplementary groups.
    with Sandbox.create(backend=start_chain) as sbx:
        trace = Trace(sbx.id)
        sbx.run_code("print(1)")
        for pid in trace.processes():
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            assert status["Uid"].split() == [str(trace.uid)] * 4, pid
            assert status["Gid"].split() == [str(trace.uid)] * 4, pid
            assert status["Groups"].split() == [], pid
            assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, pid


def test_etc_holds_the_sandbox_files_and_what_programs_need_of_the_hosts() -> None:
    from stockade.sandbox._process_bwrap import HOST_ETC

    with Sandbox.create() as sbx:
        listed = set(sbx.commands.run(["ls", "-A", "/etc"]).stdout.split())
        cache = sbx.commands.run(["sha256sum", "/etc/ld.so.cache"]).stdout.split()[0]
        certs = sbx.commands.run("ls /etc/ssl/certs | wc -l").stdout.strip()
    own = {"passwd", "group", "hosts", "hostname", "nsswitch.conf", "resolv.conf"}
    assert listed == own | {name for name in HOST_ETC if Path("/etc", name).exists()}
    host_cache = subprocess.run(["sha256sum", "/etc/ld.so.cache"], capture_output=True, text=True, check=True)
    assert cache == host_cache.stdout.split()[0]
    assert certs == str(len(os.listdir("/etc/ssl/certs")))


def test_a_frozen_supervisor_cannot_hold_the_host_hostage() -> None:
    sbx = Sandbox.create()
    trace = Trace(sbx.id)
    boundary = sbx.instance.boundary  # type: ignore[attr-defined]
    supervisor = next(pid for pid in boundary.cgroup.pids() if pid_in_sandbox(pid) == 1)
    os.kill(supervisor, signal.SIGSTOP)  # what a hostile process of the same uid cannot do, we can
    started = time.monotonic()
    r = sbx.commands.run("echo never", timeout_s=0.2)
    assert r.timed_out and time.monotonic() - started < 15
    assert not sbx.alive, "the host took the whole sandbox down"
    assert trace.processes() == []
    sbx.close()


REACH_SUPERVISORS_STDERR = r"""
import os, sys
reached = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    try:
        theirs, ours = os.stat(f"/proc/{pid}/fd/2"), os.fstat(2)
        os.close(os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        continue
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):  # not our own stderr pipe
        reached.append(pid)
sys.stderr.write("x" * (1 << 20))
print("reached", reached)
"""


def test_code_cannot_write_into_the_supervisors_uncapped_stderr_log() -> None:
    # bwrap.log (bwrap's and the supervisor's stderr) has no cap on the host's disk: that holds
    # only while code cannot reach it. Its own stderr is a pipe of its call; the supervisor's
    # and the zygote's fds are closed to it (non-dumpable); nothing it floods lands there.
    with Sandbox.create() as sbx:
        log = sbx.instance.boundary.rundir / "bwrap.log"  # type: ignore[attr-defined]
        sbx.files.write("reach.py", REACH_SUPERVISORS_STDERR.encode())
        ran = sbx.commands.run("python3 reach.py")
        assert ran.exit_code == 0 and ran.stdout.strip() == "reached []", ran.stdout + ran.stderr[-300:]
        cell = sbx.run_code(REACH_SUPERVISORS_STDERR)
        assert cell.error is None and cell.logs.stdout.strip() == "reached []", cell
        assert log.stat().st_size < 4096, log.read_bytes()[:300]


def test_a_sandbox_nobody_closed_dies_with_its_last_reference() -> None:
    import gc

    sbx = Sandbox.create()
    sid = sbx.id
    trace = Trace(sid)
    assert trace.processes()
    del sbx
    gc.collect()
    wait_for(lambda: not trace.processes() and not mounts_of(sid), what="a dropped sandbox to stop")


def test_a_spare_is_a_sandbox_of_its_own_with_fresh_randomness() -> None:
    from stockade.sandbox import SpareBackend
    from stockade.sandbox.process import ProcessBackend

    spare = SpareBackend(ProcessBackend())
    probe = (
        "import os, random, tempfile\n"
        "open('mine', 'w').write('x')\n"
        "print(os.urandom(8).hex(), random.random(), hash('stockade'), tempfile.mktemp())"
    )
    seen, ids, traces, forked = [], [], [], []
    try:
        for i in range(3):
            # The first create is a cold one; each later one takes the spare started after it.
            assert spare.wait_ready(30) == (i > 0)
            with Sandbox.create(backend=spare) as sbx:
                assert sbx.commands.run(["ls"]).stdout == ""  # nothing of the one before
                ex = sbx.run_code(probe)
                assert ex.error is None, ex.error
                seen.append(ex.logs.stdout.split())
                ids.append(sbx.id)
                traces.append(Trace(sbx.id))
                forked.append(from_template(sbx))
    finally:
        spare.close()
    assert len(set(ids)) == 3
    urandom, random, hashes, temp_names = zip(*seen, strict=True)
    for column in (urandom, random, temp_names):
        assert len(set(column)) == 3
    # Started from the template, every sandbox is a fork of one Python: the hash seed is the
    # template's (docs/architecture.md, the trade); a Python started per sandbox has its own.
    assert len(set(hashes)) == (1 if all(forked) else 3)
    for sid, trace in zip(ids, traces, strict=True):
        assert mounts_of(sid) == [] and trace.processes() == []


def test_the_sandboxs_code_runs_below_the_supervisors_priority() -> None:
    # Below the supervisor, which then always gets the CPU to enforce a deadline in time.
    with Sandbox.create() as sbx:
        assert sbx.run_code("import os\nos.nice(0)").text == "19"
        assert sbx.commands.run(["nice"]).stdout == "19\n"
        sbx.run_code("import os\nos._exit(0)")  # the interpreter dies: the next run starts another
        assert sbx.run_code("import os\nos.nice(0)").text == "19"


JUDGE_PROBE = r"""
import json, sys
from pathlib import Path
from stockade import Sandbox
from stockade.sandbox.process import ProcessBackend
from stockade.types import SandboxRules

backend = ProcessBackend(state_dir=Path(sys.argv[1]))
seen = {}
for name, rules in (("none", None), ("rules", SandboxRules(approve=("rm -r",)))):
    with Sandbox.create(backend=backend, rules=rules) as sbx:
        seen[name] = sbx.commands.run("ls /opt/stockade").stdout.split()
print(json.dumps(seen))
"""


def test_a_sandbox_without_rules_never_waits_for_the_judges_compiler(tmp_path: Path) -> None:
    """The compiled exec judge is built (about a second, once per host) by the first sandbox
    with rules, not by every tier's first start: a new user's first sandbox without a policy
    ships what is cached, and nothing is compiled for it."""
    import json
    import shutil
    import tempfile

    cache = tmp_path / "cache"
    env = {**os.environ, "STOCKADE_CACHE": str(cache)}
    # The sandboxes' state where their uids can reach it (pytest's folders are root's alone).
    with tempfile.TemporaryDirectory(prefix="stockade-judge-") as state:
        os.chmod(state, 0o711)
        done = subprocess.run(
            [sys.executable, "-c", JUDGE_PROBE, str(Path(state) / "state")],
            capture_output=True, text=True, check=False, timeout=120, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert "judge.so" not in seen["none"]
    assert "supervisor.py" in seen["none"]
    if shutil.which("gcc") or shutil.which("cc"):
        assert "judge.so" in seen["rules"]
        assert list((cache / "judge").glob("judge-*.so"))


def test_a_launcher_in_a_cache_another_user_owns_is_refused_and_never_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found from outside: root ran the launcher another user left in a shared STOCKADE_CACHE.
    require("root (to give the cache to another uid)", os.geteuid() == 0, "only root chowns")
    from stockade.exceptions import UntrustedPath
    from stockade.sandbox import _launch, _native

    cache, marker = tmp_path / "sharedcache", tmp_path / "pwned"
    planted = _native._target(_launch.SOURCE, _launch.FLAGS, cache / "launch")
    planted.parent.mkdir(parents=True)
    planted.write_text(f"#!/bin/sh\nid > {marker}\nexit 0\n")
    planted.chmod(0o755)
    for path in (cache, planted.parent, planted):
        os.chown(path, 65534, 65534)
    monkeypatch.setenv("STOCKADE_CACHE", str(cache))
    with pytest.raises(UntrustedPath, match="owned by uid 65534"):
        Sandbox.create(backend=ProcessBackend(state_dir=tmp_path / "state"))
    assert not marker.exists()
