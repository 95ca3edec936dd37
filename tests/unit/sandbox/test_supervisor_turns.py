"""One turn of the supervisor's loop (supervisor/eventloop.py): the deadline's kill comes
first, and an event whose descriptor an earlier part of the turn closed is not dispatched."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from stockade.sandbox.supervisor import proctree
from tests.conftest import wait_for
from tests.unit.sandbox.supervisor_modules import supervisor_module


@pytest.fixture(scope="module")
def poller_type() -> Any:
    return supervisor_module("eventloop").Poller


def test_an_event_closed_earlier_in_the_turn_is_not_dispatched(poller_type: Any) -> None:
    poller = poller_type()
    first, second = os.pipe(), os.pipe()
    try:
        for r, w in (first, second):
            poller.register(r, 1, ("out", None))  # EPOLLIN
            os.write(w, b"x")
        ready = poller.select(1.0)
        assert len(ready) == 2
        closed = ready[1][0]
        poller.unregister(closed.fd)  # what a deadline's kill does to the interpreter's pipes
        os.close(closed.fd)
        reused = os.pipe()  # the closed number, taken again by a new descriptor
        try:
            assert reused[0] == closed.fd
            poller.register(reused[0], 1, ("out", None))
            assert [poller.holds(key) for key, _ in ready] == [True, False]
        finally:
            poller.unregister(reused[0])
            os.close(reused[0])
            os.close(reused[1])
    finally:
        os.close(first[0])
        os.close(first[1])
        os.close(second[1])


def test_a_group_is_killed_in_one_call() -> None:
    # a shim leads its own session; what its code forked (without a session of its own) dies at once
    leader = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        wait_for(lambda: len(_children(leader.pid)) == 2, what="the two sleeps")
        children = _children(leader.pid)
        proctree.kill_group(leader.pid)
        assert leader.wait(timeout=10) == -9
        wait_for(lambda: not any(_alive(pid) for pid in children), what="the group's processes to die")
    finally:
        leader.kill()
        leader.wait()


def test_killing_a_group_spares_a_process_that_leads_none() -> None:
    child = subprocess.Popen(["sleep", "30"])  # our own group: killing "its" group would kill us
    try:
        proctree.kill_group(child.pid)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def test_a_group_member_adopted_outside_the_tree_dies_with_it() -> None:
    # What gVisor's kill of a group leaves: a child forked as the kill came, then adopted
    # outside the dead leader's tree (here the leader exits, and its child goes to init).
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!"], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    try:
        wait_for(lambda: _parent(member) != leader.pid, what="the leader to end and its child to be adopted")
        proctree.kill_tree(leader.pid, include_root=True)
        wait_for(lambda: not _alive(member), what="the adopted member to die")
    finally:
        leader.stdout.close()
        leader.wait()
        if _alive(member):
            os.kill(member, 9)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(word) for word in fh.read().split()]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[1])


def test_a_pass_kills_the_tree_but_spares_what_it_must() -> None:
    # root -> a -> b, root -> c -> d: c protected (with d), a spared (b dies all the same)
    parent = "sh -c 'sleep 30 & exec sleep 30'"  # a sleep with a child: lives on without it
    root = subprocess.Popen(["sh", "-c", f"{parent} & {parent} & wait"], start_new_session=True)
    try:
        wait_for(lambda: len(_children(root.pid)) == 2, what="two children")
        a, c = _children(root.pid)
        wait_for(lambda: len(_children(a)) == 1 and len(_children(c)) == 1, what="theirs")
        b, d = _children(a), _children(c)
        killed = proctree.kill_descendants(root.pid, spare=a, protect=frozenset({c}))
        assert sorted(killed) == sorted(b)
        wait_for(lambda: not any(_alive(pid) for pid in b), what="a's children to die")
        assert all(_alive(pid) for pid in (root.pid, a, c, *d))
    finally:
        os.killpg(root.pid, 9)  # all of them: one group
        root.wait()


def test_the_output_pipes_wait_no_longer_than_a_gather_even_if_the_clock_went_back() -> None:
    # A supervisor restored from a memory snapshot on another machine finds a monotonic clock
    # far behind the one its due time was taken on: the wait is cut, the pipes read at once.
    jobs = supervisor_module("jobs")
    pipes = jobs.Outputs(sup=None, key=("out", None))  # no pipe: only its schedule is asked
    assert pipes.wait(100.0) is None, "watched pipes: nothing to wait for"
    pipes.due = 100.0 + jobs.GATHER_S / 2
    assert pipes.wait(100.0) == pytest.approx(jobs.GATHER_S / 2)
    pipes.due = 5000.0
    assert pipes.wait(100.0) == 0


def test_a_slow_writer_gathers_and_a_fast_one_is_read_as_it_writes() -> None:
    # A wait slows a writer that fills the pipe within it (blocked on the full pipe: 100 MB
    # of head -c took 5 s instead of 1): only what trickles in is left to gather.
    jobs = supervisor_module("jobs")
    gather, bulk, fast = jobs.GATHER_S, jobs.BULK, jobs.FAST_S

    def read(n: int, after: float, full: bool = False, last: float = 100.0) -> Any:
        pipes = jobs.Outputs(sup=None, key=("out", None))  # no pipe: only its schedule is asked
        pipes.read_at = last
        return pipes.next_read(n, full, last + after), pipes

    assert read(12_000, gather)[0] == pytest.approx(100.0 + 2 * gather), "a print flood's 2 ms: gathers"
    assert read(6, 0.00001)[0] == pytest.approx(100.0 + 0.00001 + gather), "a line: gathers"
    assert read(bulk, gather)[0] is None, "half a pipe in a gather: read as it comes"
    assert read(8192, 0.00002)[0] is None, "8 KiB in 20 us: read as it comes"
    assert read(jobs.CHUNK, 900.0, full=True)[0] == 1000.0, "a full read after a quiet spell: read on"
    _, pipes = read(8192, 0.00002)
    assert pipes.next_read(6, False, 100.0 + fast) is None, "a while after a fast read: still as it comes"
    later = 100.0 + 2 * fast
    assert pipes.next_read(6, False, later) == pytest.approx(later + gather), "then gathers again"
