"""The process tier's template: a sandbox's supervisor forked from one warm Python, made its pid 1.

A pid 1 made that way must be what bwrap makes of the pid 1 it execs, in everything a
sandbox's security rests on; the template must hold nothing of a sandbox, and must not
outlive its backend nor its host.
"""

from __future__ import annotations

import fcntl
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.sandbox import _template
from stockade.sandbox.process import ProcessBackend
from tests.conftest import processes_of_uid, require, require_tier, wait_for

NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2): the user namespace that owns this one
# What /proc/PID/status says of a sandbox's security: each must be the same both ways.
STATUS = (
    "Uid", "Gid", "Groups", "Umask", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
    "NoNewPrivs", "Seccomp", "Seccomp_filters", "SigBlk", "SigIgn", "SigCgt",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _as_root_with_the_template() -> None:
    require_tier("process")
    require("root (the template starts sandboxes as root only)", os.geteuid() == 0)
    require("bubblewrap 0.8 (--userns, --pidns)", _template.supported(ProcessBackend().bwrap))


def pid_1(sbx: Sandbox) -> int:
    return int(sbx.instance.boundary.proc.pid if from_template(sbx) else sandbox_init(sbx))  # type: ignore[attr-defined]


def from_template(sbx: Sandbox) -> bool:
    return isinstance(sbx.instance.boundary.proc, _template.Init)  # type: ignore[attr-defined]


def sandbox_init(sbx: Sandbox) -> int:
    """bwrap's child: the supervisor it exec'd."""
    bwrap = sbx.instance.boundary.proc.pid  # type: ignore[attr-defined]
    return int(Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()[0])


def user_namespace_depth(pid: int) -> int:
    """How many user namespaces deep ``pid`` runs (the host's is 0)."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    depth = 0
    while True:
        try:
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
        except OSError:  # EPERM at the host's own
            os.close(fd)
            return depth
        os.close(fd)
        fd, depth = parent, depth + 1


def user_namespaces_allowed_above(pid: int) -> str:
    """``user.max_user_namespaces`` in the user namespace that owns ``pid``'s (bwrap's
    --disable-userns sets it to 1 there, then nests the one the sandbox runs in), read by a
    fresh process that joins it: not a fork of ours, which the handlers libraries register
    for forks (OpenTelemetry's exporters restart their thread in the child) can leave with
    a second thread, and a process of more than one thread cannot join a user namespace."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    parent = fcntl.ioctl(fd, NS_GET_PARENT)
    os.close(fd)
    join = (
        "import ctypes, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.setns(int(sys.argv[1]), 0) != 0:\n"
        "    print('setns failed:', os.strerror(ctypes.get_errno()), end='')\n"
        "else:\n"
        "    print(open('/proc/sys/user/max_user_namespaces').read().strip(), end='')\n"
    )
    try:
        command = [sys.executable, "-S", "-c", join, str(parent)]
        said = subprocess.run(command, check=False, pass_fds=(parent,), capture_output=True, text=True)
    finally:
        os.close(parent)
    return said.stdout or said.stderr


NETWORK_SETTINGS = ("/proc/sys/net/ipv4/tcp_max_tw_buckets", "/proc/sys/net/core/tstamp_allow_data")


def portrait(sbx: Sandbox) -> dict[str, object]:
    """Pid 1 of ``sbx`` in what its security rests on, with the sandbox's own names (its host
    uid, its cgroup's name, its run folder) replaced, so that two sandboxes compare."""
    pid = pid_1(sbx)
    uid = os.stat(f"/proc/{pid}").st_uid

    def plain(text: str) -> str:
        text = re.sub(rf"\b{uid}\b", "UID", text)
        return text.replace(sbx.id, "SANDBOX")

    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    found: dict[str, object] = {name: plain(" ".join(fields[name].split())) for name in STATUS}
    host_ns = {name: os.readlink(f"/proc/self/ns/{name}") for name in os.listdir("/proc/self/ns")}
    found["new namespaces"] = sorted(
        name for name, ns in host_ns.items() if os.readlink(f"/proc/{pid}/ns/{name}") != ns
    )
    found["user namespace depth"] = user_namespace_depth(pid)
    found["user namespaces allowed above it"] = user_namespaces_allowed_above(pid)
    for name in ("uid_map", "gid_map", "setgroups", "limits", "cgroup"):
        found[name] = plain(" ".join(Path(f"/proc/{pid}/{name}").read_text().split()))
    found["cgroups from inside"] = sbx.commands.run(["cat", "/proc/1/cgroup"]).stdout
    found["mounts"] = sorted(
        " ".join(line.split()[4:6]) + " " + line.split(" - ")[1].split()[0]
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    )
    found["root"] = sorted(os.listdir(f"/proc/{pid}/root/"))
    found["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    found["leads its session"] = int(stat[3]) == pid
    found["pid inside"] = fields["NSpid"].split()[-1]
    found["dumpable"] = sbx.commands.run("ls -l /proc/1/fd 2>&1 | head -1").stdout.split(":")[0]
    found["unshare inside"] = sbx.commands.run("unshare -U true 2>&1; echo $?").stdout.split()[-1]
    # its network namespace's own settings (the host's where it shares the host's)
    found["network settings"] = sbx.commands.run(f"cat {' '.join(NETWORK_SETTINGS)}").stdout.split()
    return found


@pytest.mark.parametrize("network", ["none", "walled", "host"])
def test_a_template_started_pid_1_is_what_bwrap_makes_of_the_one_it_execs(network: str) -> None:
    from stockade import NetworkPolicy

    kwargs: dict[str, object] = {}
    if network != "none":  # the whole network: walled (a namespace of its own), or the host's
        kwargs = {"network": NetworkPolicy(enabled=True), "allow_weaker": True}
    # One host uid pinned for every sandbox: the walls cannot tell them apart, the host's stack is shared.
    pinned = {"host_uid": 65534} if network == "host" else {}
    with (
        Sandbox.create(backend=ProcessBackend(start="exec", **pinned), **kwargs) as executed,  # type: ignore[arg-type]
        Sandbox.create(backend=ProcessBackend(start="template", **pinned), **kwargs) as forked,  # type: ignore[arg-type]
    ):
        assert from_template(forked) and not from_template(executed)
        theirs, ours = portrait(executed), portrait(forked)
    assert theirs["user namespace depth"] == 2 and theirs["user namespaces allowed above it"] == "1"
    assert theirs["Seccomp"] == "2" and theirs["CapBnd"] == "0000000000000000" and theirs["pid inside"] == "1"
    different = {name: (theirs[name], ours[name]) for name in theirs if theirs[name] != ours[name]}
    assert different == {}
    # A namespace of its own keeps no TIME_WAIT and no timestamp carrying data (bwrap's exec
    # start kept the host's); the host's, shared, is never written.
    host = [Path(name).read_text().strip() for name in NETWORK_SETTINGS]
    assert theirs["network settings"] == (host if network == "host" else ["0", "0"])


def test_a_sandbox_whose_rules_mask_the_placeholder_starts_from_the_template() -> None:
    from stockade.types import SandboxRules

    rules = SandboxRules(deny=("cat",))  # masked: bwrap binds /dev/null over the program
    with Sandbox.create(backend=ProcessBackend(start="template"), rules=rules) as sbx:
        assert from_template(sbx)
        assert sbx.commands.run("cat /etc/hostname").exit_code != 0
        assert sbx.run_code("print(1)").logs.stdout == "1\n"


def test_the_template_holds_nothing_of_a_sandbox() -> None:
    backend = ProcessBackend(start="template")
    with Sandbox.create(backend=backend) as sbx:
        sbx.run_code("secret = 'of this user'")
        template = backend._template
        assert template is not None
        fds = Path(f"/proc/{template.pid}/fd")
        held = sorted(os.readlink(fd) for fd in fds.iterdir())
        # Its socket to the host, /dev/null (stdout, stderr), its own wake-up pipe, and the
        # socket to the sandbox's keeper (closed when it reaps the keeper): no pipe of the
        # sandbox's, no log, no filter, nothing of its run folder.
        kinds = [link.split(":")[0] for link in held]
        assert kinds == ["/dev/null", "/dev/null", "pipe", "pipe", "socket", "socket"]
        maps = Path(f"/proc/{template.pid}/maps").read_text()
        assert sbx.id not in maps


def test_a_keeper_holds_its_own_sandbox_s_descriptors_only() -> None:
    backend = ProcessBackend(start="template")
    with Sandbox.create(backend=backend) as older, Sandbox.create(backend=backend) as newer:
        first, second = older.instance.boundary.proc, newer.instance.boundary.proc  # type: ignore[attr-defined]
        held = {name: _descriptors(init.keeper) for name, init in (("older", first), ("newer", second))}
        # /dev/null (stdout, stderr), pid 1's pidfd and its socket to the host: nothing of the
        # template's (its socket to the host, its wake-up pipe), nothing of the older sandbox.
        for links in held.values():
            assert sorted(link.split(":")[0] for link in links) == [
                "/dev/null", "/dev/null", "anon_inode", "socket"
            ]  # fmt: skip
        assert not {link for link in held["older"] if link.startswith("socket:")} & set(held["newer"])
        # So the older one's close reads its keeper's end (EOF) as soon as its keeper is
        # reaped, with the newer one alive: it waited out no timeout.
        older.close()
        assert first._gone and first.returncode is not None
        assert newer.run_code("print(1)").logs.stdout == "1\n"


def _descriptors(pid: int) -> list[str]:
    return [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]


def test_the_template_ends_with_its_backend_and_sandboxes_with_their_host(tmp_path: Path) -> None:
    backend = ProcessBackend(start="template")
    with Sandbox.create(backend=backend):
        pass
    assert backend._template is not None
    template = backend._template.pid
    assert Path(f"/proc/{template}").exists()
    del backend
    gc.collect()
    wait_for(lambda: not _alive(template), what="the template to end with its backend")

    # A host that dies (SIGKILL: nothing of it runs) takes its sandboxes with it: each keeper
    # sees the host's end of its socket close, kills its pid 1 and ends; the template ends.
    host = subprocess.Popen(
        [sys.executable, "-c", HOST],
        stdout=subprocess.PIPE,
        env={**os.environ, "STOCKADE_PROCESS_START": "template"},
        cwd=tmp_path,
    )
    assert host.stdout is not None
    uid, template = (int(word) for word in host.stdout.readline().split())
    assert processes_of_uid(uid) and _alive(template)
    host.kill()
    host.wait()
    host.stdout.close()
    gone = lambda: not processes_of_uid(uid) and not _alive(template)  # noqa: E731
    wait_for(gone, what="the sandbox and the template to end with their host")


HOST = textwrap.dedent(
    """
    import os, time
    from stockade import Sandbox
    from stockade.sandbox.process import ProcessBackend

    backend = ProcessBackend()
    sbx = Sandbox.create(backend=backend)
    sbx.commands.run("sleep 300 &")
    uid = os.stat(f"/proc/{sbx.instance.boundary.proc.pid}").st_uid
    print(uid, backend._template.pid, flush=True)
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_template_killed_from_outside_is_started_again() -> None:
    backend = ProcessBackend(start="template")
    Sandbox.create(backend=backend).close()
    assert backend._template is not None
    first = backend._template.pid
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: not _alive(first), what="the template to die")
    with Sandbox.create(backend=backend) as sbx:
        assert from_template(sbx) and backend._template.pid != first
        assert sbx.run_code("print(1)").logs.stdout == "1\n"


def test_a_keeper_killed_takes_its_sandbox_down() -> None:
    backend = ProcessBackend(start="template")
    sbx = Sandbox.create(backend=backend)
    init = sbx.instance.boundary.proc  # type: ignore[attr-defined]
    uid = os.stat(f"/proc/{init.pid}").st_uid
    os.kill(init.keeper, signal.SIGKILL)  # pid 1's parent: its parent-death signal kills it
    wait_for(lambda: not processes_of_uid(uid), what="the sandbox to die with its keeper")
    assert not sbx.alive
    sbx.close()
