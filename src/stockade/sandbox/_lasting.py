"""Children forked by a thread that lives as long as the process.

A parent-death signal (``PR_SET_PDEATHSIG``: ``setpriv --pdeathsig``, bwrap's
``--die-with-parent``) fires when the *thread* that forked the child exits, not the process:
a microVM started from a thread that then ended (a ``threading.Thread``, a pool's worker shut
down, a web server's idle worker thread) was killed with it, and its next call found the
sandbox gone. What carries such a signal is forked here instead (``spawn``), by one thread
that never ends; the caller waits for it, and owns what it returns.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["spawn"]

T = TypeVar("T")


class _Forker:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def run(self, start: Callable[[], T]) -> T:
        if threading.current_thread() is self.thread:
            return start()
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="stockade-forker", daemon=True)
                self.thread.start()
        done: Future[T] = Future()
        self.jobs.put((start, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            start, done = self.jobs.get()
            try:
                done.set_result(start())
            except BaseException as error:  # the caller's to handle: this thread must live on
                done.set_exception(error)
            del start, done  # nor hold the last job's child while it waits for the next


_forker = _Forker()


def spawn(start: Callable[[], T]) -> T:
    """``start()`` (a ``subprocess.Popen`` of a child with a parent-death signal) run on the
    thread that lives as long as the process: the child dies with the process, never with the
    thread that asked for it. Its result or its exception, as if called here."""
    return _forker.run(start)
