"""Slot: one thing made ahead, held for the next taker, never held after close."""

from __future__ import annotations

import threading

from stockade.sandbox._slot import Slot
from tests.conftest import in_forked_child


def _slot() -> tuple[Slot[str], list[str]]:
    discarded: list[str] = []
    return Slot(discarded.append), discarded


def test_one_is_made_at_a_time_and_taken_once() -> None:
    slot, discarded = _slot()
    assert slot.take() is None and not slot.filling
    assert slot.begin() and slot.filling
    assert not slot.begin()  # one is being made
    assert slot.put("a") and not slot.filling
    assert not slot.begin()  # one is held
    assert slot.peek() == "a"
    assert slot.take() == "a" and slot.take() is None
    assert discarded == []


def test_what_is_put_while_one_is_held_or_after_close_is_refused_and_discarded() -> None:
    slot, discarded = _slot()
    assert slot.put("a")
    assert not slot.put("b") and discarded == ["b"]  # refused: discarded by the slot
    assert slot.begin() is False
    slot.close()
    assert discarded == ["b", "a"] and slot.take() is None
    assert not slot.begin() and not slot.put("c")
    slot.close()  # idempotent
    assert discarded == ["b", "a", "c"]


def test_one_made_after_close_is_discarded_before_a_wait_returns() -> None:
    # Who closes the slot and waits knows nothing made for it is left: a process that ended
    # next left a QEMU started ahead half made (its folder and cgroup on the host).
    gone = threading.Event()

    def discard(thing: str) -> None:
        gone.wait(5)  # a discard that takes a while (a QEMU stopped)

    slot: Slot[str] = Slot(discard)
    assert slot.begin()
    slot.close()
    maker = threading.Thread(target=lambda: slot.put("late"))
    maker.start()
    assert slot.wait(0.2) is False and slot.filling  # its discard has not ended yet
    gone.set()
    assert slot.wait(5) is False and not slot.filling
    maker.join()


def test_a_failed_making_ends_and_the_next_may_begin() -> None:
    slot, _ = _slot()
    assert slot.begin()
    slot.done()
    assert not slot.filling and slot.begin()


def test_drop_discards_the_held_one() -> None:
    slot, discarded = _slot()
    slot.drop()
    assert discarded == []
    slot.put("a")
    slot.drop()
    assert discarded == ["a"] and slot.peek() is None and not slot.closed


def test_wait_returns_when_the_making_ends() -> None:
    slot, discarded = _slot()
    assert slot.wait(0) is False  # nothing being made: at once
    assert slot.begin()
    assert slot.wait(0.01) is False  # still being made
    maker = threading.Thread(target=lambda: slot.put("a"))
    maker.start()
    assert slot.wait(5) is True
    maker.join()
    slot.close()  # a close while one is being made: its put is refused
    assert slot.begin() is False
    assert discarded == ["a"]


def test_a_forked_childs_copy_is_closed_and_idle_and_leaves_the_parents_alone() -> None:
    """The child's close and wait hung for ever on a thing the parent was making when it
    forked: no thread of the child ever ends it. What the parent holds is the parent's."""
    slot, discarded = _slot()
    assert slot.put("held")
    making, _ = _slot()
    assert making.begin()  # a thread of the parent is making one

    def child() -> object:
        making.close()
        slot.close()
        return [making.wait(), making.filling, making.begin(), slot.take(), discarded]

    assert in_forked_child(child) == [False, False, False, None, []]
    assert slot.take() == "held" and making.filling  # the parent's, as they were
    assert making.put("made") and making.take() == "made"
