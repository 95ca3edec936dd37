"""Where an exec's path leads, resolved as the process that asked for it resolves it.

The judge reads a path the caller wrote, and the caller's view is not the supervisor's: its
working folder, its /proc/self, the links on the way (``caller_path``), and ".." parts that
follow the links before them (``exec_path``). Apart from the judge: where a path leads is a
matter of the kernel's rules alone, not of any command rule. Standard library only.
"""

from __future__ import annotations

import os


def exec_path(pid: int, path: str) -> str:
    """``path`` (absolute, no "." part) with its ".." parts resolved as the process ``pid``
    resolves them, its last name kept (a link's name is what the rules judge). Lexically,
    /tmp/l/../../usr/bin/true was /usr/bin/true, a program of the image, while the kernel
    ran true beside the folders /tmp/l leads to: a copy the code wrote there, of a program
    the rules name. ``OSError`` where the folder is only the caller's to walk (/proc/PID)."""
    if "/.." not in path:
        return path
    folder, _, name = path.rpartition("/")
    if name == "..":
        folder, name = path, ""
    real = caller_path(pid, folder or "/")
    if real.startswith("/proc/"):
        raise OSError(ELOOP, "a folder reached through the caller's /proc", path)
    return f"{real.rstrip('/')}/{name}" if name else real


def caller_path(pid: int, path: str) -> str:
    """``path`` resolved as the process ``pid`` resolves it (ExecVerdicts._in_view): a relative
    one from its working folder; ``OSError`` (ELOOP) past 40 links, as the kernel."""
    if not path.startswith("/"):
        path = f"/proc/{pid}/cwd/{path}"
    todo = [part for part in path.split("/") if part]
    done = ""
    hops = 0
    while todo:
        if done.startswith("/proc/") and done[6:].isdigit():  # the caller's: the kernel's to follow
            return "/".join([done, *todo])
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            done = done.rsplit("/", 1)[0]
            continue
        here = f"{done}/{part}"
        if here in ("/proc/self", "/proc/thread-self"):
            done = f"/proc/{pid}"
            continue
        try:
            target = os.readlink(here)
        except OSError:  # no link (or nothing there: the stat after says so)
            done = here
            continue
        hops += 1
        if hops > 40:
            raise OSError(ELOOP, "too many levels of symbolic links", path)
        if target.startswith("/"):
            done = ""
        todo = [part for part in target.split("/") if part] + todo
    return done or "/"


ELOOP = 40
