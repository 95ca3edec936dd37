"""Threads that live as long as the process, for what must outlive the thread that asked.

A parent-death signal (``PR_SET_PDEATHSIG``: ``setpriv --pdeathsig``, bwrap's
``--die-with-parent``) fires when the *thread* that forked the child exits, not the process:
a microVM started from a thread that then ended (a ``threading.Thread``, a pool's worker shut
down, a web server's idle worker thread) was killed with it, and its next call found the
sandbox gone. ``spawn`` forks such a child on one thread that never ends (the caller waits
for it, and owns what it returns); ``LastingThread.submit`` runs jobs there without waiting
(the spares and the QEMU started ahead, ``stockade.sandbox.spare``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["LastingThread", "spawn"]

T = TypeVar("T")


class LastingThread:
    """One thread, started at the first job, that runs jobs one after another for the rest
    of the process. A forked child has no such thread, and the jobs queued are its parent's:
    its own start afresh."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._fresh()
        os.register_at_fork(after_in_child=self._fresh)

    def _fresh(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    @property
    def current(self) -> bool:
        """Whether the caller is this thread (which must not wait for a job of its own)."""
        return threading.current_thread() is self.thread

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` there, later; what it raises is dropped (the thread goes on)."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self.thread.start()
        self.jobs.put(job)

    def call(self, start: Callable[[], T]) -> T:
        """``start()`` run there: its result or its exception, as if called here."""
        if self.current:
            return start()
        done: Future[T] = Future()

        def job() -> None:
            try:
                done.set_result(start())
            except BaseException as error:  # the caller's to handle
                done.set_exception(error)

        self.submit(job)
        return done.result()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            with contextlib.suppress(Exception):  # this thread must outlive all it started
                job()
            del job  # nor hold what the last job held while it waits for the next


# Forks only (each a moment): never behind a spare's start, which takes seconds.
_forker = LastingThread("stockade-forker")


def spawn(start: Callable[[], T]) -> T:
    """``start()`` (a ``subprocess.Popen`` of a child with a parent-death signal) run on the
    thread that lives as long as the process: the child dies with the process, never with the
    thread that asked for it. Its result or its exception, as if called here."""
    return _forker.call(start)
