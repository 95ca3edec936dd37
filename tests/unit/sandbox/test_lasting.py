"""The threads that outlive their callers (``stockade.sandbox._lasting``): a call runs there
and answers as if run here, and a forked child gets threads of its own (its parent's are not
in it: a fork waited for ever on the parent's forker)."""

from __future__ import annotations

import os

import pytest

from stockade.sandbox._lasting import LastingThread, spawn


def test_a_call_runs_on_the_lasting_thread_and_answers_as_if_here() -> None:
    lasting = LastingThread("stockade-test")
    assert lasting.call(lambda: lasting.current) is True and not lasting.current
    missing: dict[str, int] = {}
    with pytest.raises(KeyError):
        lasting.call(lambda: missing["key"])
    assert lasting.call(lambda: lasting.call(lambda: 7)) == 7  # from the thread itself: at once


def test_a_forked_child_spawns_on_a_thread_of_its_own() -> None:
    assert spawn(os.getpid) == os.getpid()  # the parent's forker is running now
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's
        try:
            os.write(write, str(spawn(os.getpid)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        said = answer.read()
    os.waitpid(child, 0)
    assert said == str(child)
