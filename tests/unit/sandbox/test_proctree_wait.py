"""Killing a tree waits for each killed process to be gone before it looks again
(supervisor/proctree.py): by a pidfd where there is one, not a fixed pause."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from stockade.sandbox.supervisor import proctree


def test_the_wait_for_a_killed_process_ends_when_it_is_gone() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        started = time.monotonic()
        proctree.wait_gone([child.pid], 5.0)
        waited = time.monotonic() - started
        if hasattr(os, "pidfd_open"):
            assert waited < 2.0, "the pidfd said it was gone"
        # gone means exited: a zombie until we reap it, not running nor sleeping
        with open(f"/proc/{child.pid}/stat", "rb") as fh:
            assert fh.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    finally:
        child.kill()
        child.wait()


def test_no_wait_for_processes_already_gone() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    started = time.monotonic()
    proctree.wait_gone([child.pid], 5.0)
    assert time.monotonic() - started < (2.0 if hasattr(os, "pidfd_open") else 6.0)


def test_our_children_are_read_from_every_thread_but_those_said_childless() -> None:
    """``own_children`` reads each thread's children file (a child's parent is the thread
    that forked it), but not a thread it is told never forks (the compiled judge's): one
    /proc file less opened after each command."""
    import threading

    forked = threading.Event()
    done = threading.Event()
    started: list[tuple[int, subprocess.Popen[bytes]]] = []

    def fork_here() -> None:
        started.append((threading.get_native_id(), subprocess.Popen(["sleep", "30"])))
        forked.set()
        done.wait(30)  # alive, and the child's parent, while we look

    thread = threading.Thread(target=fork_here)
    thread.start()
    try:
        assert forked.wait(30)
        tid, child = started[0]
        try:
            assert child.pid in (proctree.own_children() or set())
            assert child.pid not in (proctree.own_children(frozenset((tid,))) or set())
        finally:
            child.kill()
            child.wait()
    finally:
        done.set()
        thread.join()
