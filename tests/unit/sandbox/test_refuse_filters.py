"""``callfilters.refuse_filters``: no seccomp filter may be added after it, by either route
and with any flags, while the calls that load nothing (asking what an action is, which mode a
process is in) and everything else work. Installed in a fresh Python, as the supervisor
installs it on itself; the sandboxes are in the integration tests (``test_host_limits``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stockade.sandbox import _judge

SUPERVISOR = Path(_judge.SOURCE).parent

PROBE = r"""
import ctypes, errno, json, os, struct, sys
sys.path.insert(0, sys.argv[1])
import callfilters
libc = ctypes.CDLL(None, use_errno=True)
allow = ctypes.create_string_buffer(struct.pack("HBBI", 6, 0, 0, 0x7FFF0000))
program = struct.pack("HxxxxxxQ", 1, ctypes.addressof(allow))
action = struct.pack("I", 0x7FFF0000)
def outcome(result):
    return "done" if result >= 0 else errno.errorcode[ctypes.get_errno()]
calls = {
    "seccomp": lambda: libc.syscall(317, 1, 0, program),
    "seccomp_tsync": lambda: libc.syscall(317, 1, 1, program),  # SECCOMP_FILTER_FLAG_TSYNC
    "prctl": lambda: libc.prctl(22, 2, program, 0, 0),
    "action_avail": lambda: libc.syscall(317, 2, 0, action),  # SECCOMP_GET_ACTION_AVAIL
    "get_seccomp": lambda: libc.prctl(21, 0, 0, 0, 0) - 2,  # PR_GET_SECCOMP: 2, filtered
    "other_prctl": lambda: libc.prctl(7, 0, 0, 0, 0),  # PR_GET_KEEPCAPS
}
before = {name: outcome(call()) for name, call in calls.items() if name.startswith(("action", "other"))}
callfilters.refuse_filters()
after = {name: outcome(call()) for name, call in calls.items()}
after["fork"] = os.waitstatus_to_exitcode(os.waitpid(os.fork() or os._exit(3), 0)[1])
print(json.dumps([before, after]))
"""


def test_no_filter_is_added_after_it_and_other_calls_work() -> None:
    probe = [sys.executable, "-c", PROBE, str(SUPERVISOR)]
    done = subprocess.run(probe, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    assert before == {"action_avail": "done", "other_prctl": "done"}
    assert after == {
        "seccomp": "EPERM", "seccomp_tsync": "EPERM", "prctl": "EPERM", "action_avail": "done",
        "get_seccomp": "done", "other_prctl": "done", "fork": 3,
    }  # fmt: skip
