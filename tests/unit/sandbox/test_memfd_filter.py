"""``callfilters.deny_calls(no_memfd=True)``: where no exec listener refuses memfds (gVisor), the
supervisor's own filter fails memfd_create and memfd_secret with EPERM, even where the
filter also refuses memfd_secret by its list (ENOSYS), while the rest of the list keeps its
ENOSYS and everything else works. Installed in a fresh Python, as the supervisor installs it
on itself; the sandboxes are in the integration tests (``test_gvisor_tier``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.sandbox import _judge

SUPERVISOR = Path(_judge.SOURCE).parent

PROBE = r"""
import ctypes, errno, json, os, sys
sys.path.insert(0, sys.argv[1])
import callfilters
libc = ctypes.CDLL(None, use_errno=True)
def outcome(result):
    return "done" if result >= 0 else errno.errorcode[ctypes.get_errno()]
callfilters.deny_calls(
    (callfilters.NR_IO_SETUP, callfilters.NR_MEMFD_SECRET),
    guard_init=True,
    no_memfd=sys.argv[2] == "no_memfd",
)
found = {
    "memfd_create": outcome(libc.memfd_create(b"program", 0)),
    "memfd_secret": outcome(libc.syscall(callfilters.NR_MEMFD_SECRET, 0)),
    "io_setup": outcome(libc.syscall(callfilters.NR_IO_SETUP, 1, ctypes.byref(ctypes.c_ulong(0)))),
    "pipe": outcome(os.pipe()[0]),
    "fork": os.waitstatus_to_exitcode(os.waitpid(os.fork() or os._exit(3), 0)[1]),
}
print(json.dumps(found))
"""


@pytest.mark.parametrize("memfds", ["no_memfd", "made"])
def test_memfds_are_refused_with_eperm_only_when_asked(memfds: str) -> None:
    probe = [sys.executable, "-c", PROBE, str(SUPERVISOR), memfds]
    done = subprocess.run(probe, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    refused = memfds == "no_memfd"
    assert json.loads(done.stdout) == {
        "memfd_create": "EPERM" if refused else "done",
        "memfd_secret": "EPERM" if refused else "ENOSYS",
        "io_setup": "ENOSYS",
        "pipe": "done",
        "fork": 3,
    }
