"""Starts ``durable_child.py`` processes for ``test_runs_durable`` from an interpreter that has
imported what they import: each is a process of its own, forked, without the imports a new
interpreter spends first (0.5-1 s each; a trial starts two to four processes, a test 40-60).

    python durable_forks.py

Reads a request a line from stdin (JSON) and answers each with a line:

- ``{"args": [...], "stdout": PATH, "stderr": PATH}``: forks a child running ``durable_child.py``
  with those arguments, its output to those files; ``pid PID``;
- ``{"wait": PID, "block": true|false}``: ``status CODE`` once the child has ended (its exit
  code, or minus the signal that ended it, as ``subprocess`` says), or ``running``.

Ends at the end of stdin. It holds nothing a child inherits but its imports: no thread, no
store, no sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import stockade.agent
import stockade.audit
import stockade.audit.agent
import stockade.models.scripted
import stockade.runs
import stockade.sandbox.process
import stockade.tools  # noqa: F401 - the children's imports

with contextlib.suppress(ImportError):  # the PostgreSQL stores' (the test skips without it)
    import psycopg  # noqa: F401

CHILD = str(Path(__file__).with_name("durable_child.py"))


def _run(args: list[str], stdout: str, stderr: str) -> int:
    """In the forked child: ``durable_child.py`` as its own interpreter would run it."""
    for fd, path in ((0, os.devnull), (1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC if fd else os.O_RDONLY, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [CHILD, *args]
    try:
        runpy.run_path(CHILD, run_name="__main__")
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            pid, status = os.waitpid(request["wait"], 0 if request["block"] else os.WNOHANG)
            print(f"status {os.waitstatus_to_exitcode(status)}" if pid else "running", flush=True)
            continue
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's
            code = 1
            try:
                code = _run(request["args"], request["stdout"], request["stderr"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)


if __name__ == "__main__":
    main()
