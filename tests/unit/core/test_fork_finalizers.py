"""What ends a host resource (a sandbox, a spare, a QEMU started ahead) at collection or at
exit runs only in the process that made it: a forked child inherits the finalizers, and its
exit ran them, killing its parent's sandboxes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HOST = r"""
import os, sys
from stockade import _exit

class Held:
    pass

def end(path, who):
    with open(path, "a") as ended:
        ended.write(f"{who} {os.getpid()}\n")

kept, dropped = Held(), Held()
_exit.finalize(kept, end, sys.argv[1], "at exit")
_exit.finalize(dropped, end, sys.argv[1], "collected")
pid = os.fork()
if pid == 0:
    del dropped  # collected in the child, and the child ends as a program does
    sys.exit(0)
os.waitpid(pid, 0)
print(os.getpid())
del dropped
"""


def test_a_finalizer_runs_only_in_the_process_that_made_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ended = tmp_path / "ended"
    command = [sys.executable, "-c", HOST, str(ended)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    parent = done.stdout.strip()
    assert ended.read_text().splitlines() == [f"collected {parent}", f"at exit {parent}"]
