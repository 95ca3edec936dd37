"""The sandbox filters keep every file lock owned by a process the host can count (``_locks``):
OFD locks, which belong to an open file that can outlive every process, are refused (EINVAL,
as before Linux 3.15), and so are threads with a descriptor table of their own (EPERM), while
POSIX locks, SQLite, threads and subprocesses work.

Each filter is installed in a fresh Python here, as a sandbox's first process installs it:
the process tier's (``_seccomp.filter_bpf``, which bubblewrap loads) and the container tiers'
(``callfilters.deny_calls``, the supervisor's own). The sandboxes themselves are in the
integration tests (``test_host_limits``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.sandbox import _judge, _seccomp

SUPERVISOR = Path(_judge.SOURCE).parent

PROCESS_TIER = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
code = open(sys.argv[1], "rb").read()
buf = ctypes.create_string_buffer(code, len(code))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(Program(len(code) // 8, ctypes.addressof(buf))), 0, 0) == 0
"""
CONTAINER_TIERS = r"""
import sys
sys.path.insert(0, sys.argv[1])
import callfilters
callfilters.deny_calls([], netlink=True, datagrams=True, locks=True)
"""
PROBE = r"""
import ctypes, errno, fcntl, json, os, sqlite3, struct, subprocess, tempfile, threading
found = {}
libc = ctypes.CDLL(None, use_errno=True)
# A thread of a descriptor table of its own: flags the kernel refuses anyway (EINVAL: a thread
# needs CLONE_SIGHAND), so that nothing is made where no filter stands; clone3's size 0 likewise.
for name, call, flags in (("own_table_thread", 56, 0x00010000), ("clone3", 435, 0)):
    found[name] = errno.errorcode[ctypes.get_errno()] if libc.syscall(call, flags, 0, 0, 0, 0) < 0 else "made"
folder = tempfile.mkdtemp()
with open(folder + "/file", "w") as f:
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
    found["posix"] = "held"
    for name, command in (("F_OFD_GETLK", 36), ("F_OFD_SETLK", 37), ("F_OFD_SETLKW", 38)):
        try:
            fcntl.fcntl(f, command, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 10, 1, 0))
            found[name] = "done"
        except OSError as error:
            found[name] = errno.errorcode[error.errno]
db = sqlite3.connect(folder + "/db")
with db:
    db.execute("create table t (x)")
for i in range(4):
    with db:
        db.execute("insert into t values (?)", (i,))
found["sqlite"] = db.execute("select sum(x) from t").fetchone()[0]
worker = threading.Thread(target=lambda: None)
worker.start()
worker.join()
found["thread"] = "ran"
found["subprocess"] = subprocess.run(["true"]).returncode
found["fork"] = os.waitstatus_to_exitcode(os.waitpid(os.fork() or os._exit(3), 0)[1])
print(json.dumps(found))
"""


@pytest.mark.parametrize("tier", ["process", "container"])
def test_ofd_locks_are_refused_and_ordinary_locks_work(tmp_path: Path, tier: str) -> None:
    if tier == "process":
        program = tmp_path / "filter.bpf"
        program.write_bytes(_seccomp.filter_bpf())
        install, argument = PROCESS_TIER, str(program)
    else:
        install, argument = CONTAINER_TIERS, str(SUPERVISOR)
    probe = [sys.executable, "-c", install + PROBE, argument]
    done = subprocess.run(probe, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "posix": "held",
        "F_OFD_GETLK": "EINVAL",
        "F_OFD_SETLK": "EINVAL",
        "F_OFD_SETLKW": "EINVAL",
        "sqlite": 6,
        "thread": "ran",
        "subprocess": 0,
        "fork": 3,
        "own_table_thread": "EPERM",
        "clone3": "ENOSYS",
    }
