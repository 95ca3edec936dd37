"""The microVM tier beyond the shared suites: the guest's shape, and QEMU's lifetime on the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import Limits, Sandbox, SandboxPool, SandboxRules
from stockade import exceptions as exc
from stockade.sandbox import _guest, microvm
from stockade.sandbox._microvm_instance import GUEST_OVERHEAD_MB, VMInstance
from stockade.sandbox.base import SandboxSpec
from stockade.types import Mechanism
from tests.conftest import require_tier, wait_for
from tests.integration.approvals import YesTo, remove_each
from tests.integration.microvm_images import BootImages

MiB = 1024 * 1024


@pytest.fixture
def vm() -> Iterator[Sandbox]:
    require_tier("microvm")
    with Sandbox.create("microvm", limits=Limits(memory_mb=200, cpus=2, disk_mb=48, inodes=3000)) as sandbox:
        yield sandbox


def qemu_processes(sandbox_id: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            program = cmdline.split(b"\0")[0]
            if program.endswith(b"qemu-system-x86_64") and f"stockade-{sandbox_id}".encode() in cmdline:
                found.append(int(name))
    return found


def test_the_guest_has_the_limits_as_its_hardware(vm: Sandbox) -> None:
    assert vm.commands.run("nproc").stdout.strip() == "2"
    mem_kib = int(vm.commands.run("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    assert mem_kib * 1024 <= (200 + GUEST_OVERHEAD_MB) * MiB
    fs = vm.run_code("import os; s = os.statvfs('/workspace'); (s.f_blocks * s.f_frsize, s.f_files)")
    assert fs.text == f"({48 * MiB}, 3000)"


def test_the_guest_has_no_network_device(vm: Sandbox) -> None:
    devices = vm.commands.run("tail -n +3 /proc/net/dev | cut -d: -f1").stdout.split()
    assert devices == ["lo"]


def test_the_root_filesystem_is_a_read_only_image(vm: Sandbox) -> None:
    mounts = vm.commands.run("cat /proc/mounts").stdout.splitlines()
    root = next(line.split() for line in mounts if line.split()[1] == "/")
    assert root[2] == "ext4" and "ro" in root[3].split(",")


# What the sandbox's /dev holds: each name with its kind (a device's numbers and mode, a
# link's target), and the options /dev is mounted with.
DEV = """
import os, stat
def kind(name):
    s = os.lstat("/dev/" + name)
    if stat.S_ISCHR(s.st_mode):
        return ("c", os.major(s.st_rdev), os.minor(s.st_rdev), oct(stat.S_IMODE(s.st_mode)))
    return os.readlink("/dev/" + name) if stat.S_ISLNK(s.st_mode) else "folder"
mounts = [line.split() for line in open("/proc/self/mounts")]
({name: kind(name) for name in os.listdir("/dev")}, [m[2:4] for m in mounts if m[1] == "/dev"])
"""


def test_the_sandboxs_dev_holds_only_the_devices_anyone_may_use(vm: Sandbox) -> None:
    # It was the guest's whole devtmpfs: its disk, the host's ports, mem, kmsg, the consoles,
    # out of reach by their modes alone. Now a small tmpfs of its own, as on the other tiers.
    names, mounts = eval(vm.run_code(DEV).text or "")
    devices = {
        "null": (1, 3),
        "zero": (1, 5),
        "full": (1, 7),
        "random": (1, 8),
        "urandom": (1, 9),
        "tty": (5, 0),
    }
    assert names == {
        **{name: ("c", *numbers, "0o666") for name, numbers in devices.items()},
        "fd": "/proc/self/fd",
        "stdin": "/proc/self/fd/0",
        "stdout": "/proc/self/fd/1",
        "stderr": "/proc/self/fd/2",
        "shm": "folder",
        "mqueue": "folder",
    }
    ((fs, options),) = mounts
    assert fs == "tmpfs" and {"nosuid", "noexec"} <= set(options.split(","))
    used = vm.commands.run(
        "head -c 16 /dev/urandom | wc -c; echo lost > /dev/null; echo out > /dev/stdout;"
        " echo shared > /dev/shm/x && cat /dev/shm/x && rm /dev/shm/x"
    )
    assert used.stdout == "16\nout\nshared\n", used.stderr


def test_the_enforcement_says_how(vm: Sandbox) -> None:
    e = vm.enforcement
    assert (e.memory, e.cpus, e.network) == (Mechanism.VM, Mechanism.VM, Mechanism.VM)
    assert e.weakened == ()


def test_closing_ends_the_vm_on_the_host(vm: Sandbox) -> None:
    assert len(qemu_processes(vm.id)) == 1
    vm.close()
    assert qemu_processes(vm.id) == []


def test_leftovers_of_a_dead_creator_are_collected(tmp_path: Path) -> None:
    """A VM whose creating process died (without closing it) is killed by the next collection."""
    require_tier("microvm")
    sid = "sbx-0123456789ab"
    # Stands in for the QEMU of the dead process: the collector matches the name on its argv.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"stockade-{sid}"])
    # the kernel fills in the argv just after the exec the parent waited for
    wait_for(
        lambda: f"stockade-{sid}".encode() in Path(f"/proc/{stand_in.pid}/cmdline").read_bytes(),
        what="the stand-in's argv",
        interval_s=0.01,
    )
    rundir = _guest.default_state_dir() / f"vm-{sid}"
    rundir.mkdir(parents=True)
    # A creator that is not running: no process has this pid.
    owner = {"pid": stand_in.pid, "host": _guest.current_creator().host, "creator": "999999999:1"}
    (rundir / "owner.json").write_text(json.dumps(owner))
    try:
        assert f"microvm {sid}" in microvm.collect_garbage()
        assert stand_in.wait(timeout=5) == -9
        assert not rundir.exists()
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_live_creators_vm_is_left_alone(vm: Sandbox) -> None:
    microvm.collect_garbage()
    assert vm.commands.run("echo alive").stdout == "alive\n"


def test_qemu_runs_under_its_own_seccomp_filter(vm: Sandbox) -> None:
    (pid,) = qemu_processes(vm.id)
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Seccomp:\t2" in status


# -- QEMU's jail ------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _mounts(pid: int) -> dict[str, list[str]]:
    """QEMU's mount points, each with its options (from its mountinfo)."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        out[fields[4]] = fields[5].split(",")
    return out


def _files(root: Path, *, skip: tuple[str, ...]) -> list[Path]:
    out = []
    for folder, folders, names in os.walk(root):
        if Path(folder) == root:
            folders[:] = [name for name in folders if name not in skip]
        out += [Path(folder, name) for name in names]
    return out


def assert_jailed(sandbox: Sandbox) -> None:
    """What a guest that broke into its QEMU would hold on the host: no capability at all
    (none to use, none to regain), namespaces of its own, and a view of the host's files
    that holds only what QEMU needs, read-only but for its console's file (and a RAM file
    it writes through, when building an image)."""
    (pid,) = qemu_processes(sandbox.id)
    status = _status(pid)
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"
    for ns in ("pid", "mnt", "net", "ipc", "uts"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    root = Path(f"/proc/{pid}/root")
    for host_path in ("home", "var/lib/docker", "etc/passwd", "etc/shadow", "root/.bashrc", "sys"):
        assert not (root / host_path).exists(), host_path
    # Every file it sees outside /usr and its own /dev, /proc, /tmp: the guest's kernel, its
    # initramfs and root image, its console's file, the image's RAM, the loader's cache.
    seen = {Path("/", path.relative_to(root)) for path in _files(root, skip=("usr", "dev", "proc", "tmp"))}
    vm = sandbox.instance
    assert isinstance(vm, VMInstance)
    rundir = vm.vm.rundir
    needed = ("vmlinuz-*", "microvm-initrd-*.cpio", "microvm/rootfs-*.ext4", "objects/*", "qemu_ram-*.so")
    for path in seen - {Path("/etc/ld.so.cache"), rundir / "console.log"}:
        assert any(path.match(pattern) for pattern in needed), path
    assert sorted(p.name for p in (root / "proc").iterdir() if p.name.isdigit()) <= ["1", "2"]
    writable = [point for point, options in _mounts(pid).items() if "rw" in options]
    allowed = ("/", "/dev", "/dev/shm", "/dev/pts", "/dev/mqueue", "/proc", "/tmp")
    assert [point for point in writable if point not in allowed and not point.startswith("/dev/")] == [
        str(_guest.default_state_dir() / f"vm-{sandbox.id}" / "console.log")
    ]


def test_qemu_runs_jailed_with_no_capability(vm: Sandbox) -> None:
    assert_jailed(vm)
    assert vm.run_code("1 + 1").text == "2"


def test_qemu_sees_no_host_process_and_no_network(vm: Sandbox) -> None:
    (pid,) = qemu_processes(vm.id)
    # bwrap's init and QEMU, nothing of the host's
    assert len([p for p in Path(f"/proc/{pid}/root/proc").iterdir() if p.name.isdigit()]) == 2
    devices = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in devices] == ["lo"]


def test_qemu_is_jailed_on_every_start(tmp_path: Path, microvm_boot_images: BootImages) -> None:
    """A cold boot, a boot image's, a ready image's (its RAM the store's object, mapped copy on
    write from a read-only mount) and a memory snapshot's restore: each QEMU jailed alike."""
    require_tier("microvm")
    store = microvm_boot_images(tmp_path / "store")
    cold = microvm.MicroVMBackend(boot_snapshots=False, start_ahead=False)
    with Sandbox.create("microvm", backend=cold) as booted:
        assert _started_from(booted) == "cold boot"
        assert_jailed(booted)
    backend = microvm.MicroVMBackend(snapshot_store=store)
    try:
        with Sandbox.create("microvm", backend=backend) as first:
            assert _started_from(first) == "boot image"
            assert_jailed(first)
            first.files.write("kept.txt", "yes")
            snapshot = first.snapshot(memory=True, store=store)
        backend.wait_ahead(180)
        with Sandbox.create("microvm", backend=backend) as ready:
            assert _started_from(ready) == "ready image"
            assert_jailed(ready)
            (pid,) = qemu_processes(ready.id)
            ram = [p for p, options in _mounts(pid).items() if p.startswith(str(store.root))]
            assert len(ram) == 1 and "ro" in _mounts(pid)[ram[0]]
        with Sandbox.create("microvm", backend=backend, snapshot=snapshot) as restored:
            assert _started_from(restored) == "memory snapshot"
            assert_jailed(restored)
            assert restored.files.read("kept.txt") == "yes"
    finally:
        backend.close()


# -- starts from the boot image --------------------------------------------------------------

DRAWS = (
    "import os, random, tempfile, time, uuid\n"
    "(os.urandom(16).hex(), random.random(), tempfile.mktemp(), uuid.uuid4().hex,"
    " open('/proc/sys/kernel/random/boot_id').read(), time.time())"
)


def test_a_qemu_started_ahead_becomes_the_next_sandbox_and_ends_with_close(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """The next start takes the QEMU started ahead (its guest run for the first time then,
    reseeded first): each guest draws its own randomness, has its own id and the host's
    time. Closing the backend ends the one waiting."""
    require_tier("microvm")
    backend = microvm.MicroVMBackend(
        snapshot_store=microvm_boot_images(tmp_path / "store"), ready_images=False
    )
    draws = []
    try:
        with Sandbox.create("microvm", backend=backend) as first:
            draws.append(eval(first.run_code(DRAWS).text or ""))
            ahead = backend.wait_ahead(120)
            assert ahead is not None and ahead != first.id
            assert len(qemu_processes(ahead)) == 1  # waiting before anyone asked
        with Sandbox.create("microvm", backend=backend) as second:
            assert second.id == ahead
            draws.append(eval(second.run_code(DRAWS).text or ""))
        with Sandbox.create("microvm", backend=backend, envs={"WHO": "third"}) as third:
            assert third.run_code("import os; os.environ['WHO']").text == "'third'"
            draws.append(eval(third.run_code(DRAWS).text or ""))
        for column in list(zip(*draws, strict=True))[:5]:  # urandom, random, temp names, uuid, boot id
            assert len(set(column)) == len(column), column
        for _, _, _, _, _, clock in draws:
            assert abs(clock - time.time()) < 60
        waiting = backend.wait_ahead(120)
        assert waiting is not None
    finally:
        backend.close()
    assert qemu_processes(waiting) == []
    assert not (_guest.default_state_dir() / f"vm-{waiting}").exists()


def _started_from(sandbox: Sandbox) -> str:
    instance = sandbox.instance
    assert isinstance(instance, VMInstance)
    return instance.started_from


def _flip_a_byte(path: Path) -> None:
    """Change one byte in place: its size and modification time may stay, its change time cannot."""
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 1]))


def test_a_modified_boot_image_is_refused_and_the_qemu_that_loaded_it_dropped(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """A byte of the boot image's RAM changed after a QEMU was started ahead on it: that QEMU
    is never handed out, and no guest starts from the image (the sandbox boots cold)."""
    require_tier("microvm")
    store = microvm_boot_images(tmp_path / "store")
    backend = microvm.MicroVMBackend(snapshot_store=store, ready_images=False)
    try:
        with Sandbox.create("microvm", backend=backend):
            pass
        ahead = backend.wait_ahead(120)
        assert ahead is not None
        for _, ref in store.refs("boot"):  # this machine's, and the others' the store holds
            _flip_a_byte(store.object_path(store.load(ref).blobs["ram"]))
        with Sandbox.create("microvm", backend=backend) as cold:
            assert cold.id != ahead
            assert cold.run_code("1 + 1").text == "2"
        assert qemu_processes(ahead) == []
        assert backend.wait_ahead(0) is None  # nothing is started ahead from a refused image
    finally:
        backend.close()


def test_a_configuration_seen_before_starts_from_its_ready_image(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """After a first start, the boot image configured as that sandbox was, its interpreter
    started, is kept (a ready image): the next sandboxes of that configuration start from it,
    their interpreter already there (started in the image), each with its own randomness and
    an empty workspace. Other limits start as before (and get an image of their own)."""
    require_tier("microvm")
    store = microvm_boot_images(tmp_path / "store")
    backend = microvm.MicroVMBackend(snapshot_store=store)
    try:
        with Sandbox.create("microvm", backend=backend) as first:
            assert first.run_code("1").text == "1"
            assert _started_from(first) == "boot image", backend._boot_failed
        backend.wait_ahead(180)
        ready = [name for name, _ in store.refs("boot") if name.startswith("microvm-ready-")]
        assert len(ready) == 1
        seen = []
        for _ in range(2):
            with Sandbox.create("microvm", backend=backend) as clone:
                assert _started_from(clone) == "ready image"
                seen.append(eval(clone.run_code(DRAWS).text or ""))
                assert clone.files.list() == []
                clone.files.write("mine.txt", "x")
        for column in list(zip(*seen, strict=True))[:5]:
            assert len(set(column)) == len(column), column
        with Sandbox.create("microvm", backend=backend, limits=Limits(pids=64)) as other:
            assert other.run_code("1 + 1").text == "2"
            assert _started_from(other) == "boot image"
        backend.wait_ahead(180)
        ready_now = [ref for name, ref in store.refs("boot") if name.startswith("microvm-ready-")]
        assert len(ready_now) == 2  # the other limit's own (another rlimit in the guest)
        for ref in ready_now:  # modified: refused, and sandboxes start as before
            _flip_a_byte(store.object_path(store.load(ref).blobs["ram"]))
        with Sandbox.create("microvm", backend=backend) as after:
            assert _started_from(after) == "boot image"
            assert after.run_code("1 + 1").text == "2"
    finally:
        backend.close()


ENVIRON = "import os; list(os.environ.items())"
CHILD = (
    "import subprocess; subprocess.run('echo $API_TOKEN', shell=True, capture_output=True, text=True).stdout"
)


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    """Every file under ``root`` whose bytes hold ``needle`` (read in pieces: RAM files are large)."""
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        tail = b""
        with open(path, "rb") as fh:
            while piece := fh.read(8 * MiB):
                if needle in tail + piece:
                    found.append(path)
                    break
                tail = piece[-len(needle) :]
    return found


def test_a_callers_variables_reach_a_sandbox_from_a_ready_image_and_no_file_of_the_store(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """The ready image is made without the caller's variables (a variable may be a secret):
    a sandbox started from it gets them after the resume, and its commands, its interpreter's
    os.environ (the same items in the same order as in a cold start) and the interpreter's
    children see them, after a reset too. The value is in no file of the snapshot store; a
    sandbox without them, from the same image, has none of them."""
    require_tier("microvm")
    store = microvm_boot_images(tmp_path / "store")
    backend = microvm.MicroVMBackend(snapshot_store=store)
    secret = "tok-" + os.urandom(12).hex()
    envs = {"API_TOKEN": secret, "LANG": "C"}  # a variable of its own, and one of the defaults
    try:
        with Sandbox.create("microvm", backend=backend, envs=envs) as first:
            assert _started_from(first) == "boot image", backend._boot_failed
            cold = first.run_code(ENVIRON).text
            assert f"('API_TOKEN', '{secret}')" in (cold or "")
        backend.wait_ahead(180)
        with Sandbox.create("microvm", backend=backend, envs=envs) as sbx:
            assert _started_from(sbx) == "ready image"
            assert sbx.commands.run("echo $API_TOKEN $LANG").stdout == f"{secret} C\n"
            assert sbx.run_code(ENVIRON).text == cold
            assert sbx.run_code(CHILD).text == repr(secret + "\n")
            sbx.reset()
            assert sbx.run_code(ENVIRON).text == cold
            assert sbx.commands.run("echo $API_TOKEN").stdout == f"{secret}\n"
        with Sandbox.create("microvm", backend=backend) as plain:
            assert _started_from(plain) == "ready image"
            assert "API_TOKEN" not in (plain.run_code(ENVIRON).text or "")
            assert plain.commands.run("echo $LANG").stdout == "C.UTF-8\n"
    finally:
        backend.close()
    assert [name for name, _ in store.refs("boot") if name.startswith("microvm-ready-")] != []
    assert _files_holding(store.root, secret.encode()) == []


def test_a_sandbox_with_rules_starts_from_its_ready_image_and_holds_them(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """Rules are configuration: the image holds them configured (the judge, Landlock, the
    masks), and each sandbox from it holds them as one started cold: a denied program
    masked, an argv rule judged (the host's approver asked), writes only where allowed.
    Other rules are another image."""
    require_tier("microvm")

    approver = YesTo("src/yes")
    rules = SandboxRules(deny=("uname",), approve=("rm -r",), write=("src/**",))
    store = microvm_boot_images(tmp_path / "store")
    backend = microvm.MicroVMBackend(snapshot_store=store)
    try:
        with Sandbox.create("microvm", backend=backend, rules=rules, approver=approver) as first:
            assert _started_from(first) == "boot image", backend._boot_failed
            enforcement = first.enforcement
        backend.wait_ahead(180)
        for _ in range(2):
            approver.asked.clear()
            with Sandbox.create("microvm", backend=backend, rules=rules, approver=approver) as sbx:
                assert _started_from(sbx) == "ready image"
                assert sbx.enforcement == enforcement
                assert enforcement.commands is Mechanism.SECCOMP_NOTIFY
                assert enforcement.paths is Mechanism.LANDLOCK and enforcement.programs is Mechanism.MASK
                r = sbx.commands.run(
                    "uname; echo x > top.txt; mkdir -p src/yes src/no; echo ok > src/a; cat src/a"
                )
                assert "Linux" not in r.stdout and r.stdout.endswith("ok\n"), (r.stdout, r.stderr)
                assert not sbx.files.exists("top.txt")
                code = sbx.run_code(remove_each("src/yes", "src/no"))
                assert code.text == "[0, 'refused']", code
                assert approver.asked == [("rm", "-r", "src/yes"), ("rm", "-r", "src/no")]
                assert not sbx.files.exists("src/yes") and sbx.files.exists("src/no")
        with Sandbox.create("microvm", backend=backend, rules=SandboxRules(deny=("uname", "curl"))) as other:
            assert _started_from(other) == "boot image"  # other masks: another machine and image
    finally:
        backend.close()


def test_a_configurations_first_start_comes_from_the_ready_image_built_ahead(
    tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """``prepare_for`` (a deploy step, ``stockade prepare``) builds the machine's boot image and
    the configuration's ready image, and starts a QEMU ahead on it: the very first sandbox of
    that configuration starts from it (in that QEMU), its rules in force before any code
    runs; the limits read per request (the timeout, the output cap) are not the image's, and
    hold all the same. A pool has its members' image built before its first fill: its first
    member starts from it too."""
    require_tier("microvm")
    store = microvm_boot_images(tmp_path / "store")
    backend = microvm.MicroVMBackend(snapshot_store=store)
    rules = SandboxRules(deny=("uname",), write=("src/**",))
    try:
        made = backend.prepare_for(SandboxSpec(rules=rules))
        assert made == "ready image", (backend._boot_failed, backend._ready.refused)
        assert backend.prepare_for(SandboxSpec(rules=rules)) == "ready image"  # found, not built again
        ahead = backend.wait_ahead(120)  # and a QEMU started ahead on it, for the first start
        limits = Limits(timeout_s=3, output_bytes=1000)
        with Sandbox.create("microvm", backend=backend, rules=rules, limits=limits) as sbx:
            assert sbx.started_from == "ready image" and sbx.id == ahead
            assert sbx.enforcement.paths is Mechanism.LANDLOCK and sbx.enforcement.programs is Mechanism.MASK
            r = sbx.commands.run("uname; echo x > top.txt; echo ok")
            assert "Linux" not in r.stdout and r.stdout.endswith("ok\n"), (r.stdout, r.stderr)
            assert not sbx.files.exists("top.txt")
            out = sbx.commands.run("head -c 50000 /dev/zero | tr '\\0' a")
            assert out.truncated and out.stdout_bytes == 50000 and len(out.stdout) < 1200
            slow = sbx.run_code("import time; time.sleep(30)")
            assert slow.timed_out
        pool = SandboxPool("microvm", backend=backend, size=1, limits=Limits(pids=64))
        with pool, pool.acquire(timeout_s=600) as member:
            assert member.started_from == "ready image", backend._ready.refused
            assert member.run_code("1 + 1").text == "2"
    finally:
        backend.close()


# Fills the guest's RAM-backed folders, then forks children that allocate until the kernel's OOM
# killer ends them: how many it killed.
OOM_KILLS = """
import os, time
for folder, count in (("/workspace", 40), ("/tmp", 32), ("/dev/shm", 32)):
    for i in range(count):
        try:
            open(f"{folder}/fill{i}", "wb").write(b"x" * (1 << 20))
        except OSError:
            break
kills, started = 0, time.time()
while time.time() - started < 8:
    pid = os.fork()
    if pid == 0:
        hog = []
        try:
            while True:
                hog.append(bytearray(4 << 20))
        except MemoryError:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    kills += os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
kills
"""


def test_code_that_provokes_oom_kills_writes_nothing_to_the_hosts_console_file(vm: Sandbox) -> None:
    # Each OOM kill wrote a kernel line (its process's name chosen by the code) to the console,
    # a file on the host's disk that grew ~260 bytes a second for the sandbox's whole life.
    instance = vm.instance
    assert isinstance(instance, VMInstance)
    console = instance.vm.rundir / "console.log"
    before = console.stat().st_size
    kills = vm.run_code(OOM_KILLS, timeout_s=60)
    assert kills.error is None and int(kills.text or "0") >= 2, (kills.text, kills.error)
    assert console.stat().st_size - before < 200, console.read_text(errors="replace")[-2000:]


def test_a_guest_gone_for_no_reason_the_host_sees_is_reported_with_its_consoles_last_words(
    vm: Sandbox,
) -> None:
    # A guest whose QEMU ends by itself (exit 0: a panic with panic=-1, a poweroff) had its
    # next call fail with "the supervisor exited" alone; what its kernel printed last now says why
    instance = vm.instance
    assert isinstance(instance, VMInstance)
    with (instance.vm.rundir / "console.log").open("a") as console:
        console.write("Kernel panic - not syncing: a test's last words\n")
    instance.vm.monitor().command("quit")
    with pytest.raises(exc.SandboxCrashed) as gone:
        vm.commands.run("true")
    assert "a test's last words" in str(gone.value), str(gone.value)


# How many of a file's pages are in the page cache: a read with RWF_NOWAIT fails on one that is not.
CACHED_PAGES = """
import os
def cached(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        hits = 0
        for offset in range(0, os.fstat(fd).st_size, 4096):
            try:
                os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
                hits += 1
            except BlockingIOError:
                pass
        return hits
    finally:
        os.close(fd)
"""


def test_the_next_user_of_a_pooled_guest_cannot_tell_which_files_the_last_one_read() -> None:
    """A pool's reset drops the guest kernel's page cache: a root-image file the last user read
    is not cached for the next (it would be one bit per file of what the last user did)."""
    require_tier("microvm")
    pool = SandboxPool("microvm", size=1, limits=Limits(memory_mb=256))
    with pool:
        with pool.acquire(timeout_s=600) as first:
            # A module nothing imports at start: its pages are cached only because this user read it.
            read = "import os; p = os.path.dirname(os.__file__) + '/turtle.py'; open(p, 'rb').read(); p"
            path = str(first.run_code(read).text).strip("'")
            assert first.run_code(f"{CACHED_PAGES}\ncached({path!r})").text != "0"
            used = first.id
        with pool.acquire(timeout_s=600) as second:
            assert second.id == used  # the same guest, reset
            assert second.run_code(f"{CACHED_PAGES}\ncached({path!r})").text == "0"
