"""Attacks on the sandbox machinery itself: the supervisor, the protocol, reset, the files API.

The containment suite checks that hostile code stays in; these check that it cannot take
over the parts of stockade that live beside it (the supervisor outlives every command and a
pool's reset), cannot crash the host's side of the channel with legitimate-looking output,
and cannot leave anything behind for the next user of a pooled sandbox.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from stockade import (
    Limits,
    ListingTooLarge,
    ProtocolError,
    Sandbox,
    SandboxCrashed,
    SandboxPool,
    StockadeError,
)
from stockade._cuts import CUT_MARK
from stockade.exceptions import SeedTooLarge, TreeTooDeep
from stockade.runs.workspace import WorkspaceTracker
from stockade.sandbox._channel import LIVENESS_S
from stockade.sandbox._microvm_instance import VMInstance
from stockade.sandbox._supervised import SupervisedInstance
from stockade.sandbox._supervised_calls import GRACE_S
from stockade.sandbox.supervisor.protocol import MAX_CODE_REPORT
from stockade.tools.workspace_diff import MAX_TEXT_TOTAL, record_baseline, snapshot, workspace_diff
from stockade.types import EntryType, Listing, SkippedEntry
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

# A module planted in the workspace: if the supervisor ever imports it, every later
# files.read (the next pool user's included) answers with the attacker's bytes.
PLANTED_MODULE = """
import sys
for name in ("supervisor", "__main__"):
    module = sys.modules.get(name)
    if module is not None and hasattr(module, "Supervisor"):
        def op_read(self, rid, h, body):
            self.send({"id": rid, "ev": "done", "size": 7}, b"PLANTED")
        module.Supervisor.op_read = op_read
raise ImportError("planted")
"""


@pytest.fixture
def process_sbx() -> Iterator[Sandbox]:
    require_tier("process")
    with Sandbox.create("process", limits=Limits(memory_mb=256, timeout_s=20, pids=64)) as sandbox:
        yield sandbox


def test_modules_planted_in_the_workspace_never_run_in_the_supervisor(sbx: Sandbox, tmp_path: Path) -> None:
    for name in ("sitecustomize", "usercustomize", "tarfile", "shutil", "json", "ctypes"):
        sbx.files.write(f"{name}.py", PLANTED_MODULE)
    triggers = (
        lambda: sbx.run_code("1"),  # the first run_code loads site in the supervisor
        lambda: sbx.files.download_dir(tmp_path / "out"),  # tarfile, lazily
        lambda: sbx.files.remove("nothing-here"),
        sbx.reset,
    )
    for trigger in triggers:
        with contextlib.suppress(StockadeError):
            trigger()
    sbx.files.write("secret.txt", "mine")
    assert sbx.files.read("secret.txt") == "mine"


def test_user_code_still_imports_its_own_modules(sbx: Sandbox) -> None:
    sbx.files.write("helper.py", "ANSWER = 42\n")
    assert sbx.run_code("import helper\nhelper.ANSWER").text == "42"


def test_vsock_does_not_reach_the_hypervisor(sbx: Sandbox) -> None:
    # Network namespaces do not cover vsock: on a VM it reaches the host (CID 2).
    r = sbx.run_code(
        "import socket\ntry:\n    socket.socket(40, socket.SOCK_STREAM)\n    outcome = 'CREATED'\n"
        "except OSError as e:\n    outcome = type(e).__name__\noutcome"
    )
    assert r.text is not None and "CREATED" not in r.text


def test_listing_thousands_of_files_keeps_the_sandbox(sbx: Sandbox) -> None:
    # 12,000 of the 16,384 files a 256 MiB sandbox's workspace holds
    sbx.commands.run("mkdir many && cd many && seq 1 12000 | xargs touch")
    assert len(sbx.files.list("many")) == 12000
    assert sbx.commands.run("echo alive").stdout == "alive\n"


MANY_FILES = """
import os
os.makedirs("many")
fd = os.open("many", os.O_RDONLY | os.O_DIRECTORY)
for i in range(100_001):
    os.close(os.open(str(i), os.O_CREAT | os.O_WRONLY, dir_fd=fd))
os.close(fd)
"""


def test_a_listing_past_its_cap_says_it_was_cut() -> None:
    # 100,001 files were listed as 100,000 and the caller could not tell the rest was missing.
    require_tier("process")
    with Sandbox.create("process", limits=Limits(memory_mb=1536, inodes=110_000, timeout_s=60)) as sbx:
        assert sbx.run_code(MANY_FILES).error is None
        cut = sbx.files.list("many")
        assert len(cut) == 100_000 and cut.truncated
        whole = sbx.files.list("")
        assert [e.name for e in whole] == ["many"] and not whole.truncated
        # a run store allowed more entries than a listing holds would snapshot part of it
        with pytest.raises(SeedTooLarge, match="more than one listing carries"):
            WorkspaceTracker(max_entries=1_000_000).scan(sbx)


# Writes a.txt with the word it is given, then sets its mtime back to 2000-01-01; b.txt is new.
REWRITE_WITH_OLD_MTIME = """
import os
open("a.txt", "w").write(WORD)
os.utime("a.txt", (946684800, 946684800))
open("b.txt", "w").write(WORD)
"""


def test_a_file_rewritten_with_its_old_mtime_put_back_is_recorded_anew(sbx: Sandbox) -> None:
    # The run store trusted a file by its size, mode and mtime: code rewrote it at the same
    # size and put the mtime back, the store kept the old content, and a resume restored it.
    # ctime, which code cannot set, now says the file changed.
    assert sbx.run_code(REWRITE_WITH_OLD_MTIME.replace("WORD", "'AAAA'")).error is None
    tracker = WorkspaceTracker()
    tracker.commit(tracker.scan(sbx), 1)
    time.sleep(0.05)  # past the tick of the listing
    assert sbx.run_code(REWRITE_WITH_OLD_MTIME.replace("WORD", "'EVIL'")).error is None
    entry = tracker.scan(sbx).changes.get("a.txt")
    assert entry is not None and entry.digest == hashlib.sha256(b"EVIL").hexdigest()
    # every tier says each file's ctime and inode
    assert all(e.ctime_ns > 0 and e.inode > 0 for e in sbx.files.list("") if e.type == EntryType.FILE)


# 40,000 files at the end of fifteen folders of 250-character names: 3.8 KB paths each.
DEEP_TREE = """
import os
deep = "deep/" + "/".join(["d" * 250] * 15)
os.makedirs(deep)
fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
for i in range(12_000):  # ~3.8 KB of path each: 45 MB of them, over the 32 MiB a listing holds
    os.close(os.open(str(i), os.O_CREAT | os.O_WRONLY, dir_fd=fd))
os.close(fd)
"""


def test_a_listing_too_large_for_one_answer_is_refused_and_keeps_the_sandbox(
    sbx: Sandbox, tmp_path: Path
) -> None:
    # 65,521 entries of 4 KB paths made a listing of 268 MB, over the host's cap on a frame:
    # the host took it for a broken supervisor and ended the sandbox. Now a listing over
    # 32 MiB of paths is a typed refusal, and the sandbox goes on.
    assert sbx.run_code(DEEP_TREE).error is None
    with pytest.raises(ListingTooLarge, match="list a folder inside it, or to a smaller depth"):
        sbx.files.list("deep", depth=20)
    assert [e.name for e in sbx.files.list("deep")] == ["d" * 250]
    sbx.files.write("small/a.txt", "kept")
    assert sbx.files.download_dir(tmp_path / "out", "small").files == 1
    assert (tmp_path / "out" / "a.txt").read_text() == "kept"
    assert sbx.commands.run("echo alive").stdout == "alive\n"


class GrownAfterItsListing:
    """A sandbox as a scan sees it, whose files code grows right after the listing (what a
    thread of ``run_code`` left running does, watching the reads with inotify; here at a
    fixed moment, so that the race is the same on every tier and every load)."""

    def __init__(self, sandbox: Sandbox, grow: str) -> None:
        self.sandbox, self.grow = sandbox, grow
        self.instance = sandbox.instance
        self.files = self

    def list(self, path: str, *, depth: int) -> Listing:
        found = self.sandbox.files.list(path, depth=depth)
        assert self.sandbox.commands.run(self.grow).exit_code == 0
        return found


def test_files_grown_while_the_run_store_reads_them_are_held_to_its_cap(tier: str) -> None:
    # The scan checked the listing against the cap, then read every file whole: files grown
    # after the listing (sparse: free for the sandbox) made the host hold 2.5 GB for ten
    # files listed as 789 bytes. What is read now counts, and each read gets only the room
    # the cap leaves.
    cap = 4 << 20
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sandbox:
        assert sandbox.commands.run("touch f00 f01 f02 f03 f04 f05 f06 f07").exit_code == 0
        grown = GrownAfterItsListing(sandbox, f"truncate -s {cap // 3} f0*")
        with pytest.raises(SeedTooLarge, match="grew past the run store's snapshot cap"):
            WorkspaceTracker(max_bytes=cap).scan(cast(Sandbox, grown))
        assert sandbox.commands.run("echo alive").stdout == "alive\n"


# A text file of 512 KiB (the most the diff shows of one file) and 70 hard links to it: 512 KiB
# of the sandbox's disk, 37 MB of text for a snapshot of the workspace that held each: past
# MAX_TEXT_TOTAL (32 MiB), so a host that held it all fails. Not more: every byte is read
# through the sandbox's channel twice (the snapshot, the diff), seconds a MB under TCG.
# The last name, a/99.txt, comes last by name and by age, as with 100 links.
LINKED_TEXT = """
import os
os.makedirs("a")
with open("a/0.txt", "w") as f:
    f.write("line\\n" * (512 * 1024 // 5))
for i in range(30, 100):
    os.link("a/0.txt", f"a/{i}.txt")
"""


def test_the_diffs_snapshot_holds_bounded_text_whatever_the_workspace_links(sbx: Sandbox) -> None:
    # 5,000 hard links to one 512 KiB file made the host hold 2.5 GB of text per snapshot.
    sbx.files.write("z.txt", "kept\n" * 200)
    record_baseline(sbx)
    assert sbx.run_code(LINKED_TEXT).error is None
    texts = [v for v in snapshot(sbx).values() if not v.startswith("\x00")]
    assert sum(map(len, texts)) <= MAX_TEXT_TOTAL
    # Time enough to read all of it: the room is what is tried here, not the diff's 30 s, which
    # a loaded host spent on the first dozen files (the rest named, not shown, a/99.txt with them).
    diff = workspace_diff(sbx, time_s=600)
    # z.txt, text in the baseline, is past the room now and compared by its hash: unchanged
    assert [line for line in diff.splitlines() if "z.txt" in line] == []
    assert "Binary or large file a/99.txt differs" in diff  # past the room: hashed


# 300 folders in one another, a file at the bottom and one at the top.
DEEP_FOLDERS = """
import os
os.makedirs("deep")
open("deep/top.txt", "w").close()
fd = os.open("deep", os.O_RDONLY | os.O_DIRECTORY)
for _ in range(300):
    os.mkdir("a", dir_fd=fd)
    sub = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = sub
os.close(os.open("bottom.txt", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
os.close(fd)
"""


def test_a_tree_300_folders_deep_is_listed_and_downloaded_and_what_is_left_out_is_named(
    tier: str, tmp_path: Path
) -> None:
    # The supervisor held a descriptor per folder: past its RLIMIT_NOFILE (256 here, 32 in a
    # sandbox of many processes) a listing, a download and a snapshot failed as a whole with
    # "Too many open files", and the run store left what is below 128 folders out silently.
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sandbox:
        assert sandbox.run_code(DEEP_FOLDERS).error is None
        bottom = "deep/" + "a/" * 300 + "bottom.txt"
        listed = sandbox.files.list("deep", depth=400)
        assert len(listed) == 302 and bottom in {e.path for e in listed}
        assert sandbox.files.read(bottom) == ""
        # a download takes 128 folders (what the host takes in a name) and names what it left out
        got = sandbox.files.download_dir(tmp_path / "out", "deep")
        assert got.skipped == (SkippedEntry(path="/".join(["a"] * 128), kind="too deep"),)
        assert (tmp_path / "out" / "top.txt").exists() and got.directories == 127
        # a files snapshot must not lose files: it is refused, and says why (a microVM's memory
        # snapshot, its default, keeps the whole disk)
        with pytest.raises(TreeTooDeep, match="cannot snapshot the sandbox's workspace: 'deep/a/a"):
            sandbox.snapshot(memory=False)
        with pytest.raises(SeedTooLarge, match="more than 128 folders deep"):
            WorkspaceTracker().scan(sandbox)
        assert sandbox.commands.run("echo alive").stdout == "alive\n"


@pytest.mark.parametrize(
    "code",
    [
        "'a' * 3_000_000",  # a large repr (cut at 1 MiB)
        "'é' * 400_000",  # escapes make the JSON far larger than the text
        "class H:\n    def _repr_html_(self): return 'h' * 40_000_000\nH()",
        "for i in range(200_000): display(i)",
    ],
)
def test_a_large_result_keeps_the_interpreter_state(sbx: Sandbox, code: str) -> None:
    sbx.run_code("kept = 'state'")
    r = sbx.run_code(code)
    assert r.error is None, r.error
    assert sbx.run_code("kept").text == "'state'"


@pytest.mark.parametrize(
    "code",
    [
        "class E(Exception):\n    def __str__(self): raise RuntimeError('no')\nraise E()",
        "raise ValueError('v' * 5_000_000)",
        "import os\nos.close(1)\nos.close(2)",
    ],
)
def test_hostile_errors_and_closed_streams_keep_the_interpreter_state(sbx: Sandbox, code: str) -> None:
    sbx.run_code("kept = 'state'")
    r = sbx.run_code(code)
    assert r.error is None or r.error.name not in ("KernelDied", "TimeoutError")
    assert sbx.run_code("kept").text == "'state'"


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.close(1)\nos.close(2)",
        "import sys\nsys.stdout = sys.stderr = None",
        "import sys\nsys.stdout.close()\nsys.stderr.close()",
    ],
)
def test_a_cell_that_closes_its_streams_does_not_silence_the_next(sbx: Sandbox, code: str) -> None:
    sbx.run_code(code)
    r = sbx.run_code("import os, sys\nprint('out')\nprint('err', file=sys.stderr)\nos.system('echo child')")
    assert (r.logs.stdout, r.logs.stderr) == ("out\nchild\n", "err\n")


def test_a_cell_may_send_its_output_to_a_file_on_purpose(sbx: Sandbox) -> None:
    sbx.run_code("import sys\nsys.stdout = open('/tmp/log.txt', 'w', buffering=1)")
    r = sbx.run_code("print('to the log')")
    assert r.logs.stdout == "" and sbx.run_code("open('/tmp/log.txt').read()").text == "'to the log\\n'"


def test_reset_leaves_nothing_for_the_next_user(sbx: Sandbox) -> None:
    planted = sbx.run_code(
        "import os\n"
        "for place in ('/workspace', '/tmp', '/dev/shm'):\n"
        "    os.makedirs(place + '/deep/er', exist_ok=True)\n"
        "    open(place + '/deep/er/left', 'w').write('previous user')\n"
        "    os.chmod(place + '/deep', 0)\n"  # a tree its owner cannot list
        "os.chdir('/workspace')\n"
        "for _ in range(2000): os.mkdir('d'); os.chdir('d')\n"  # deeper than any recursion limit
        "os.chdir('/workspace')\n"
        "import ctypes\n"
        "ctypes.CDLL(None).shmget(0, 4096, 0o1600)\n"  # a SysV segment (IPC_CREAT; gVisor: ENOSYS)
        "os.chmod('/workspace', 0o777)\n"
        "'planted'"
    )
    assert planted.text == "'planted'", planted.error
    sbx.reset()
    r = sbx.commands.run(
        "ls -A /workspace /tmp /dev/shm; stat -c %a /workspace; "
        "tail -n +2 /proc/sysvipc/shm 2>/dev/null | wc -l"
    )
    assert r.stdout.split()[:5] == ["/dev/shm:", "/tmp:", "/workspace:", "755", "0"], r.stdout
    # A message in the empty places' times (emptying an empty folder changes none of them)
    sbx.run_code(
        "import os\n"
        "for place in ('/workspace', '/tmp', '/dev/shm'):\n"
        "    try: os.utime(place, ns=(1234567890987654321,) * 2)\n"
        "    except PermissionError: pass\n"  # not code's to set there (the microVM's)
    )
    sbx.reset()
    times = sbx.commands.run("stat -c %Y /workspace /tmp /dev/shm").stdout.split()
    assert "1234567890" not in times, times


# A process whose main thread ends alone (SYS_exit, not exit_group): its stat says Z while
# its other thread runs on, named "survivor", touching a file now and then.
SURVIVOR = """
import ctypes, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def stay():
    libc.prctl(15, b"survivor", 0, 0, 0)
    while True:
        try:
            open("/dev/shm/survivor", "w").close()
        except OSError:
            pass
        time.sleep(0.05)
if os.fork() == 0:
    os.setsid()
    threading.Thread(target=stay, daemon=True).start()
    time.sleep(0.2)
    libc.syscall(60, 0)  # this thread alone
time.sleep(0.5)
"""
SURVIVORS = "grep -l survivor /proc/[0-9]*/task/*/comm 2>/dev/null | wc -l; ls /dev/shm"


@pytest.mark.parametrize("route", ["run_code", "command"])
def test_a_process_whose_leader_ended_alone_does_not_outlive_a_reset(tier: str, route: str) -> None:
    """Taken for dead (its leader's state is Z), such a process outlived every kill: the end of
    its call, a pool's reset; it read the next user's files and the environment of their
    commands. Every kill now counts a zombie leader's live threads."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        if route == "run_code":
            sbx.run_code(SURVIVOR)
        else:
            sbx.files.write("survivor.py", SURVIVOR)
            sbx.commands.run("python3 survivor.py")
            assert sbx.commands.run(SURVIVORS).stdout.split()[0] == "0"  # ended with its command
        sbx.reset()
        time.sleep(0.3)
        assert sbx.commands.run(SURVIVORS).stdout.split() == ["0"]


def test_a_reset_that_execs_leaves_no_file_of_its_handover_open(tier: str) -> None:
    """A reset that execs a fresh supervisor (here: code killed the zygote, the interpreter's
    parent) hands its state over in an unnamed file; left open in the fresh supervisor,
    gVisor's /proc let the next user's code open it (the configuration, the baseline, the
    requests queued behind)."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        assert sbx.run_code("import os\nos.kill(os.getppid(), 9)").error is None
        sbx.reset()
        links = sbx.commands.run("for f in /proc/1/fd/*; do readlink $f; done 2>/dev/null").stdout
        unnamed = [link for link in links.splitlines() if "stockade-reset" in link or "/#" in link]
        assert unnamed == [], links  # a memfd, or an O_TMPFILE file in /dev/shm or /tmp


# Processes that hop to a new pid every few microseconds, in a few bytes of machine code:
#   again: mov edi, CLONE_VM|SIGCHLD; (the other arguments 0); mov eax, SYS_clone; syscall
#          test eax, eax; jz again           (the child hops on)
#          every 64th parent: creat("/tmp/hopper-alive", 0644); then exit_group(0)
HOPPERS = r"""
import ctypes, mmap, os
code = bytes.fromhex(
    "bf1101000031f631d24531d24531c0b8380000000f0585c074e6ff0528000000f7051e0000003f000000"
    "7513488d3d19000000bea4010000b8550000000f05b8e700000031ff0f05000000002f746d702f686f70"
    "7065722d616c69766500"
)
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
hop = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
for _ in range(20):
    if os.fork() == 0:
        os.setsid()
        hop()
"""
ALIVE = "rm -f /tmp/hopper-alive; sleep 1; ls /tmp"


def test_processes_that_hop_to_new_pids_do_not_outlive_a_reset(tier: str) -> None:
    """A scan of /proc listed pids, then read each: a process that clones and exits faster
    than that was never where the sweep looked, and it lived on into the next user's session
    (on gVisor, 1 hand-over in 3). The reset stops every process first, at once."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        for _ in range(2 if tier == "microvm" else 5):  # (a guest under TCG: slow to run)
            # the end of its call may catch them all (its own sweep, which a quiet worker runs
            # fast: 5 tries in a row caught them in CI 186): again, up to 20 times
            for _ in range(20):
                sbx.run_code(HOPPERS)
                if "hopper-alive" in sbx.commands.run("sleep 0.5; ls /tmp").stdout:
                    break
            else:
                pytest.fail("no hopper ran on past its call")
            sbx.reset()
            assert sbx.commands.run(ALIVE).stdout == "", "a hopper outlived the reset"


PLANT_IPC = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def made(ident):
    return ident if ident >= 0 else os.strerror(ctypes.get_errno())
found = [made(libc.shmget(0x5EC, 4096, 0o1666)), made(libc.msgget(0x5EC, 0o1666))]
found.append(made(libc.semget(0x5EC, 1, 0o1666)))
found.append(made(libc.mq_open(b"/stockade-left", os.O_CREAT | os.O_RDWR, 0o666, None)))
found
"""
FIND_IPC = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
[libc.shmget(0x5EC, 0, 0), libc.msgget(0x5EC, 0), libc.semget(0x5EC, 0, 0),
 libc.mq_open(b"/stockade-left", os.O_RDWR)]
"""


def test_ipc_objects_one_user_made_are_not_there_for_the_next(tier: str) -> None:
    """gVisor neither lists SysV IPC objects (/proc/sysvipc) nor mounts /dev/mqueue: a reset
    found nothing to drop, and the next user read a segment, a queue and a semaphore of the
    last. There, code may not make them (ENOSYS); elsewhere the reset drops them."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        made = sbx.run_code(PLANT_IPC).text or ""
        if tier == "gvisor":
            assert made.count("Function not implemented") == 4, made
        sbx.reset()
        assert sbx.run_code(FIND_IPC).text == "[-1, -1, -1, -1]"


def test_download_dir_leaves_out_links_out_and_special_files(sbx: Sandbox, tmp_path: Path) -> None:
    sbx.commands.run(
        "echo kept > a.txt; ln -s /etc/passwd passwd; mkfifo pipe; cp /bin/true tool; chmod 4755 tool"
    )
    done = sbx.files.download_dir(tmp_path / "out")
    assert (tmp_path / "out/a.txt").read_text() == "kept\n"
    assert (tmp_path / "out/tool").stat().st_mode & 0o7000 == 0
    assert not (tmp_path / "out/passwd").exists() and not (tmp_path / "out/pipe").exists()
    assert {(s.path, s.kind) for s in done.skipped} >= {("passwd", "link out"), ("pipe", "fifo")}


def test_a_thread_bomb_left_behind_makes_commands_fail_as_results_until_reset(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(pids=32)) as sbx:
        sbx.run_code(
            "import threading, time\nthreads = []\ntry:\n"
            "    for _ in range(200):\n"
            "        t = threading.Thread(target=time.sleep, args=(300,)); t.start(); threads.append(t)\n"
            "except RuntimeError:\n    pass"
        )
        r = sbx.commands.run("echo hi")
        assert r.exit_code != 0 or r.stdout == "hi\n"  # a result either way, never an exception
        if r.exit_code == 126:
            assert "limit is reached" in r.stderr
        sbx.reset()
        assert sbx.commands.run("echo after").stdout == "after\n"


def test_reset_removes_posix_message_queues(tier: str) -> None:
    with Sandbox.create(tier) as sbx:
        made = sbx.run_code(
            "import ctypes, os\n"
            "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
            "rt.mq_open(b'/leftover', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0 "
            "and os.path.isdir('/dev/mqueue')"
        )
        if tier == "gvisor":  # no /dev/mqueue to empty: code may make none (ENOSYS)
            assert made.text == "False"
            return
        assert made.text == "True", made
        sbx.reset()
        assert sbx.run_code("import os; os.listdir('/dev/mqueue')").text == "[]"


# The signals code could stop or end its supervisor with: the two no process can catch,
# one the supervisor ignores, one whose default (a core dump) it never changes.
SIGNALS_AT_INIT = ("STOP", "KILL", "TERM", "SEGV")
# A delayed kill: armed by a cell that returns at once, sent while nothing is in flight.
ARM_KILL_OF_INIT = (
    "import os, signal, threading, time\n"
    "threading.Thread(target=lambda: (time.sleep(0.3), os.kill(1, signal.SIG{name})), daemon=True).start()"
)


def _still_serves(sbx: Sandbox) -> None:
    """Every route to the supervisor answers, each well within its own timeout."""
    started = time.monotonic()
    sbx.files.write("after-the-signal.txt", "kept")
    assert sbx.files.read("after-the-signal.txt") == "kept"
    assert sbx.commands.run("echo still here", timeout_s=5).stdout == "still here\n"
    assert sbx.run_code("6 * 7").text == "42"
    assert sbx.alive
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("name", SIGNALS_AT_INIT)
def test_a_command_cannot_kill_or_freeze_its_supervisor(sbx: Sandbox, name: str) -> None:
    # The supervisor is the sandbox's init (pid 1). A Linux kernel delivers an init nothing
    # from inside its namespace that it has no handler for; gVisor's delivers all, and there
    # the supervisor's seccomp filter refuses any signal aimed at pid 1 (EPERM).
    started = time.monotonic()
    result = sbx.commands.run(f"kill -{name} 1; echo sent", timeout_s=5)
    assert (result.stdout, result.timed_out) == ("sent\n", False), result
    assert time.monotonic() - started < 5
    _still_serves(sbx)


@pytest.mark.parametrize("name", SIGNALS_AT_INIT)
def test_code_cannot_kill_or_freeze_its_supervisor_between_calls(sbx: Sandbox, name: str) -> None:
    assert sbx.run_code(ARM_KILL_OF_INIT.format(name=name)).error is None
    time.sleep(1)  # the kill has been tried: nothing of the sandbox's is in flight
    _still_serves(sbx)


def test_code_cannot_signal_its_supervisor_by_any_call(sbx: Sandbox) -> None:
    # Every call that names a process by pid: thread-directed, queued, a pidfd, ptrace.
    # (Where a kernel shields its init, a signal may be refused or dropped unseen.)
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for nr, args in ((200, (1, 19)), (234, (1, 1, 19)), (129, (1, 19, 0)), (297, (1, 1, 19, 0)),"
        " (62, ((1 << 32) | 1, 19)), (101, (16, 1, 0, 0))):\n"
        "    libc.syscall(nr, *args)\n"
        "try:\n    os.close(os.pidfd_open(1))\nexcept OSError:\n    pass\n"
        "'tried'"
    )
    assert sbx.run_code(code).text == "'tried'"
    time.sleep(0.5)
    _still_serves(sbx)


def test_a_pool_member_whose_user_signalled_its_supervisor_is_back_at_once(tier: str) -> None:
    limits = Limits(memory_mb=256, timeout_s=5, pids=64)
    with SandboxPool(tier, size=1, limits=limits) as pool:
        with pool.acquire() as sandbox:
            sandbox.run_code(ARM_KILL_OF_INIT.format(name="STOP"))
            time.sleep(1)
        started = time.monotonic()
        with pool.acquire(timeout_s=60) as sandbox:
            waited = time.monotonic() - started
            assert sandbox.commands.run("echo ok").stdout == "ok\n"
        assert waited < 5, waited
        assert pool.stats().replaced == 0, pool.stats()


def _supervisor_on_the_host(sbx: Sandbox) -> int:
    """The host's pid of the sandbox's supervisor: the init of the pid namespace it names."""
    namespace = sbx.run_code("import os\nos.readlink('/proc/self/ns/pid')").text
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and repr(os.readlink(entry / "ns" / "pid")) == namespace:
                status = (entry / "status").read_text()
                if status.split("NSpid:")[1].split("\n")[0].split()[-1] == "1":
                    return int(entry.name)
        except (OSError, IndexError):
            continue
    raise AssertionError(f"no process of the host is the init of {namespace}")


def _freeze_from_the_host(sbx: Sandbox) -> None:
    """The supervisor stopped by the host (as code could once stop it on gVisor), for good:
    what the host does when its supervisor stops answering, whatever stopped it. Closing
    the sandbox kills it, stopped or not."""
    os.kill(_supervisor_on_the_host(sbx), signal.SIGSTOP)


# The tiers whose supervisor is a process of the host (gVisor's and the microVM's are not:
# the host cannot stop them alone; the same wait guards them)
HOST_SEEN = [t for t in TIERS if t in ("process", "docker")]


@pytest.mark.parametrize("tier", HOST_SEEN)
def test_a_frozen_supervisor_is_noticed_in_seconds_not_minutes(tier: str) -> None:
    require_tier(tier)
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=5, pids=64)) as sbx:
        _freeze_from_the_host(sbx)
        started = time.monotonic()
        with pytest.raises(SandboxCrashed, match="did not answer"):
            sbx.files.write("a.txt", "never")
        assert time.monotonic() - started < LIVENESS_S + 5
        assert not sbx.alive


def _wedge(sbx: Sandbox) -> None:
    """The sandbox stops reading its channel for good: a host process's supervisor stopped,
    a microVM's vCPUs stopped (QMP ``stop``: a guest kernel spinning with interrupts off)."""
    if sbx.tier == "microvm":
        assert isinstance(sbx.instance, VMInstance)
        sbx.instance.vm.monitor().command("stop")
    else:
        _freeze_from_the_host(sbx)


# More than any channel's buffers hold: the send itself blocks on a sandbox that reads nothing.
LARGE = 8 << 20
# Not gVisor: its sentry is no process of the host's to stop alone, and the engine leaves a
# containerd shim running for each runsc container paused or stopped that way (three a run:
# CI runs 138 and 139); its channel is Docker's attach stream, whose bounded send the docker
# tier's tests hold.
WEDGED = [t for t in TIERS if t in ("process", "docker", "microvm")]


def _slack(tier: str) -> float:
    """What taking the wedged sandbox down may add: the engine removes a Docker container
    whose supervisor is stopped in a second alone and in 12 s beside the whole suite (CI run
    138); the others go in a second."""
    return 20.0 if tier == "docker" else 5.0


@pytest.mark.parametrize("tier", WEDGED)
def test_a_large_upload_to_a_sandbox_that_stopped_reading_ends_it_in_seconds(tier: str) -> None:
    require_tier(tier)
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=60, pids=64)) as sbx:
        _wedge(sbx)
        started = time.monotonic()
        with pytest.raises(SandboxCrashed) as crash:
            sbx.files.write("big.bin", b"y" * LARGE)
        assert crash.value.cause == "unresponsive"
        assert time.monotonic() - started < LIVENESS_S + _slack(tier)
        assert not sbx.alive
        _nothing_left_of(sbx)


@pytest.mark.parametrize("tier", WEDGED)
def test_a_large_stdin_to_a_sandbox_that_stopped_reading_ends_it_in_seconds(tier: str) -> None:
    require_tier(tier)
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=60, pids=64)) as sbx:
        _wedge(sbx)
        started = time.monotonic()
        with pytest.raises(SandboxCrashed) as crash:
            sbx.commands.run("cat > /dev/null", stdin="x" * LARGE)
        assert crash.value.cause == "unresponsive"
        assert time.monotonic() - started < LIVENESS_S + _slack(tier)
        _nothing_left_of(sbx)


@pytest.mark.parametrize("tier", WEDGED)
def test_a_command_whose_stdin_cannot_be_sent_ends_at_its_deadline(tier: str) -> None:
    require_tier(tier)
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=60, pids=64)) as sbx:
        _wedge(sbx)
        started = time.monotonic()
        result = sbx.commands.run("cat > /dev/null", stdin="x" * LARGE, timeout_s=2)
        assert result.timed_out
        assert time.monotonic() - started < 2 + GRACE_S + _slack(tier)
        _nothing_left_of(sbx)


def _nothing_left_of(sbx: Sandbox) -> None:
    """The sandbox that stopped reading was taken down already, not left for its close."""
    if sbx.tier == "microvm":
        assert isinstance(sbx.instance, VMInstance)
        assert sbx.instance.vm.proc.poll() is not None, "QEMU still runs"
    else:
        assert isinstance(sbx.instance, SupervisedInstance)
        assert not sbx.instance.boundary.alive()


@pytest.mark.parametrize("tier", HOST_SEEN)
def test_a_pool_member_whose_supervisor_froze_is_replaced_in_seconds(tier: str) -> None:
    require_tier(tier)
    with SandboxPool(tier, size=1, limits=Limits(memory_mb=256, timeout_s=5, pids=64)) as pool:
        with pool.acquire() as frozen:
            _freeze_from_the_host(frozen)
            started = time.monotonic()
        with pool.acquire(timeout_s=60) as sandbox:
            waited = time.monotonic() - started
            assert sandbox.commands.run("echo ok").stdout == "ok\n"
        assert waited < LIVENESS_S + 10, waited
        assert pool.stats().replaced == 1, pool.stats()


def test_user_modules_named_like_the_supervisors_import_as_the_users(sbx: Sandbox) -> None:
    for name in (
        "protocol",
        "interpreter",
        "reaper",
        "libc",
        "proctree",
        "fileops",
        "files",
        "jobs",
        "runcode",
        "supervisor",
    ):
        sbx.files.write(f"{name}.py", f"OWNER = 'user:{name}'\n")
        assert sbx.run_code(f"import {name}; {name}.OWNER").text == f"'user:{name}'"
    assert sbx.commands.run("echo the supervisor is unaffected").ok


# Writes a run_code report of its own into the interpreter's reply pipe, as the interpreter
# would (the pipe's fd and the request id are in the interpreter's main frame).
FORGE = """
import os, struct, sys

def forge(body, claimed=None):
    f = sys._getframe()
    while not (f.f_code.co_name == "main" and "ctl_out" in f.f_locals):
        f = f.f_back
    fd, rid = f.f_locals["ctl_out"], f.f_locals["header"]["id"]
    head = ('{"id":%d}' % rid).encode()
    view = memoryview(struct.pack(">II", len(head), len(body) if claimed is None else claimed) + head + body)
    while view:
        view = view[os.write(fd, view):]
"""


# The supervisor passes on no report past output_bytes (and a margin for the marks): these
# tests of the host's own checks ask for the most, so that the forged reports reach it.
FORGE_LIMITS = Limits(memory_mb=512, timeout_s=60, pids=64, output_bytes=MAX_CODE_REPORT)


def _memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def test_a_forged_run_code_report_cannot_swell_the_host(tier: str) -> None:
    # 30 MB of empty results made 2.5 GB of objects in the host: the host now counts the
    # report's values before parsing it, refuses it and closes the sandbox.
    with Sandbox.create(tier, limits=FORGE_LIMITS) as sbx:
        sbx.files.write("forge.py", FORGE)
        assert sbx.run_code("import forge\nflood = b'{\"results\":[' + b'{},' * 10_000_000").error is None
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
        before = _memory_kb("VmRSS")
        # The count is this thread's work, in user time: the process's clock also counts its
        # other threads (a spare sandbox starting, the reader taking in the 30 MB), and the
        # kernel's time for the memory a busy host hands out slowly (17 s of it in one run).
        cpu = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
        with pytest.raises(ProtocolError, match="oversized run_code report"):
            sbx.run_code("forge.forge(flood + b'{}],\"error\":null}')")
        grown_mb = (_memory_kb("VmHWM") - before) / 1024
        assert grown_mb < 150, f"the host grew by {grown_mb:.0f} MiB"
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_utime - cpu < 5.0
        assert not sbx.alive


def test_a_forged_report_whose_text_widens_or_of_the_wrong_shape_is_a_protocol_error(tier: str) -> None:
    # 40 MiB of JSON and one escape past U+FFFF (an emoji) parsed to 160 MiB of text; the
    # results as a number raised a TypeError out of run_code. Both are lies: typed, refused.
    with Sandbox.create(tier, limits=FORGE_LIMITS) as sbx:
        sbx.files.write("forge.py", FORGE)
        sbx.run_code("import forge")
        with pytest.raises(ProtocolError, match="malformed run_code report"):
            sbx.run_code("forge.forge(b'{\"results\": 1}')")
        emoji = "\\\\ud83d\\\\ude00"  # an escape, as JSON writes one
        head = 'b\'{"results":[{"text/plain":"\''
        widened = f"forge.forge({head} + b'a' * (40 << 20) + b'{emoji}\"}}]}}')"
        with pytest.raises(ProtocolError, match="oversized run_code report"):
            sbx.run_code(widened)
        assert not sbx.alive


def test_a_forged_report_is_held_to_the_interpreters_caps_by_the_host(tier: str) -> None:
    # A report code wrote carried 96 MiB of result text and a 120 MiB error value, past the
    # interpreter's own caps (1 Mi characters of each): the host now cuts them itself.
    with Sandbox.create(tier, limits=FORGE_LIMITS) as sbx:
        sbx.files.write("forge.py", FORGE)
        sbx.run_code("import forge")
        huge = (
            "import json\n"
            "text, value, tb = 'a' * (8 << 20), 'v' * (8 << 20), 't' * (8 << 20) + 'end'\n"
            "error = {'name': 'N' * 5000, 'value': value, 'traceback': tb}\n"
            "forge.forge(json.dumps({'results': [{'text/plain': text}], 'error': error}).encode())"
        )
        r = sbx.run_code(huge)
        assert r.truncated and r.error is not None
        assert r.results[0].text == "a" * (1 << 20) + "…"
        assert r.error.value == "v" * (1 << 20) + "…" and r.error.name == "N" * 1000 + "…"
        assert len(r.error.traceback) == (1 << 20) + 1 and r.error.traceback.endswith("tend")


def test_a_forged_report_over_the_byte_cap_only_restarts_the_interpreter(tier: str) -> None:
    # The supervisor takes no report over the cap from the interpreter's pipe: the
    # interpreter is restarted (its state is lost), the sandbox lives on.
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        sbx.files.write("forge.py", FORGE)
        r = sbx.run_code("import forge\nforge.forge(b'{\"results\":[', claimed=1 << 30)")
        assert r.error is not None and r.error.name == "KernelDied", r.error
        assert sbx.run_code("1 + 1").text == "2"


def test_a_forged_report_over_output_bytes_never_leaves_the_sandbox(tier: str) -> None:
    # The interpreter keeps a report to output_bytes; code that writes one of its own to the
    # reply pipe is stopped by the supervisor, and the interpreter and its state live on.
    with Sandbox.create(
        tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64, output_bytes=64 << 10)
    ) as sbx:
        sbx.files.write("forge.py", FORGE)
        sbx.run_code("import forge\nkept = 41")
        r = sbx.run_code("forge.forge(b'{\"results\":[{\"text/plain\":\"' + b'a' * (1 << 20) + b'\"}]}')")
        assert r.error is not None and r.error.name == "ReportTooLarge", r.error
        assert "over the sandbox's output_bytes" in r.error.value and not r.results
        assert sbx.run_code("kept + 1").text == "42"


# Objects that show themselves as PNGs of 400 KB, as large matplotlib figures do.
PICTURES = """
import os
class Picture:
    def _repr_png_(self):
        return os.urandom(400_000)
for _ in range(200):
    display(Picture())
"""


def test_results_are_held_to_output_bytes_inside_and_the_host_stays_flat(tier: str) -> None:
    # With output_bytes of 64 KiB a repr came back at 1 Mi characters, and 60 figures at 54 MB
    # of results (the host's memory 34 -> 192 MiB): the interpreter now cuts them to it, marked.
    # The default 512 MiB: each figure is cut as it is made. (On the microVM, 1 GiB was a
    # machine of its own, whose boot image no other test starts from: 20 s under TCG.)
    limits = Limits(memory_mb=512, timeout_s=60, pids=64, output_bytes=64 << 10)
    with Sandbox.create(tier, limits=limits) as sbx:
        huge = sbx.run_code("'x' * 10_000_000")
        assert huge.truncated and huge.text is not None
        assert len(huge.text) <= (64 << 10) + 100 and CUT_MARK.search(huge.text)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
        before = _memory_kb("VmRSS")
        figures = sbx.run_code(PICTURES)  # 107 MB of base64 made inside
        grown_mb = (_memory_kb("VmHWM") - before) / 1024
        assert figures.error is None and figures.truncated
        assert sum(len(v) for r in figures.results for v in r.data.values()) < (64 << 10)
        assert "image/png dropped" in str(figures.results[0].text)
        assert "199 more results dropped" in str(figures.results[-1].text)
        assert grown_mb < 30, f"the host grew by {grown_mb:.0f} MiB"


def test_the_interpreter_keeps_its_reports_within_what_the_host_accepts(sbx: Sandbox) -> None:
    many = sbx.run_code("for i in range(25_000): display(i)")
    assert many.error is None and len(many.results) == 10_000
    assert "more results dropped" in str(many.results[-1].text)
    wide = sbx.run_code(
        "class Wide:\n    def _repr_mimebundle_(self):\n"
        "        return {f'text/x-{i}': 'v' for i in range(200)}\nWide()"
    )
    assert wide.error is None and len(wide.results[0].data) <= 64
    assert "more MIME types dropped" in str(wide.results[0].text)


# Code that answers for the supervisor: it waits for the host's next command to start, then
# writes an output frame and an exit frame for every id it may have into each descriptor of
# the supervisor (and its zygote) that it can open for writing: its pipe to the host where
# /proc lets it (gVisor's, which ignores the non-dumpable flag).
IMPERSONATE = r"""
import os, struct, json, threading
def frames():
    out = b""
    for rid in range(1, 80):
        for header, body in (({"id": rid, "ev": "out", "fd": 1}, b"FORGED\n"),
                             ({"id": rid, "ev": "exit", "exit_code": 0, "signal": None}, b"")):
            raw = json.dumps(header).encode()
            out += struct.pack(">II", len(raw), len(body)) + raw + body
    return out
def ends():
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if b"\x00-B\x00-c\x00" not in open(f"/proc/{pid}/cmdline", "rb").read():
                continue  # not the supervisor, its zygote or an interpreter (python3 -S -E -s -B -c)
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for n in names:
            try:
                found.append(os.open(f"/proc/{pid}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    return found
def wait_then_forge():
    seen = set(os.listdir("/proc"))
    while True:
        now = set(os.listdir("/proc"))
        for pid in now - seen:
            try:
                if b"genuine" in open(f"/proc/{pid}/cmdline", "rb").read():
                    data = frames()
                    for fd in ends():
                        try:
                            os.write(fd, data)
                        except OSError:
                            pass
                    return
            except OSError:
                pass
        seen = now
threading.Thread(target=wait_then_forge, daemon=True).start()
"""


def test_code_never_answers_the_host_for_the_supervisor(tier: str) -> None:
    """On gVisor code opened the supervisor's pipe to the host through /proc/1/fd (its /proc
    ignores the non-dumpable flag) and answered the host's next command: the host took
    `FORGED` for its output. Every frame there is sealed now: a forged one ends the sandbox;
    elsewhere /proc keeps code out, and the answer is the command's own."""
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30, pids=64)) as sbx:
        sbx.run_code(IMPERSONATE)
        try:
            result = sbx.commands.run("sleep 2; echo genuine-output")
        except SandboxCrashed as err:
            assert "something in the sandbox wrote to the supervisor's channel" in str(err), err
            assert tier == "gvisor", err  # only where code could reach the channel at all
            return
        assert result.stdout == "genuine-output\n" and result.exit_code == 0, result
