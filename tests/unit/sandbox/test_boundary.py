"""A tier's boundary is killed once, however many callers race to kill it (close, the
garbage-collection finalizer, a timed-out call)."""

from __future__ import annotations

import threading
import time

from stockade.sandbox._supervised import Boundary


class Slow(Boundary):
    def __init__(self) -> None:
        self.kills = 0

    def _kill(self) -> None:
        self.kills += 1
        time.sleep(0.05)  # a real kill takes a while: the racers arrive meanwhile


def test_kill_runs_the_tiers_kill_once_whoever_calls_it() -> None:
    boundary = Slow()
    racers = [threading.Thread(target=boundary.kill) for _ in range(8)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    boundary.kill()
    assert boundary.kills == 1


def test_boundaries_are_killed_independently() -> None:
    first, second = Slow(), Slow()
    first.kill()
    assert (first.kills, second.kills) == (1, 0)
    second.kill()
    assert second.kills == 1
