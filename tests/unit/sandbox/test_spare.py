"""SpareBackend: a start with the spec last asked for is the sandbox started ahead of it."""

from __future__ import annotations

import gc

from stockade.sandbox import SandboxSpec, SpareBackend
from stockade.testing import FakeBackend, FakeInstance
from stockade.types import Limits


def test_the_second_start_hands_over_the_spare_and_starts_the_next() -> None:
    below = FakeBackend(tier="below")
    spare = SpareBackend(below)
    assert spare.tier == "below" and spare.probe() == below.probe()
    first = spare.start(SandboxSpec())
    assert spare.wait_ready(5)
    assert len(below.instances) == 2  # the first, and the spare started after it
    second = spare.start(SandboxSpec())
    assert second is below.instances[1] and second is not first
    assert spare.wait_ready(5) and len(below.instances) == 3
    spare.close()
    assert below.instances[2].closed and not second.closed  # handed over: the caller's


def test_another_spec_or_a_dead_spare_is_never_handed_over() -> None:
    below = FakeBackend()
    spare = SpareBackend(below)
    spare.start(SandboxSpec())
    assert spare.wait_ready(5)
    other = SandboxSpec(limits=Limits(memory_mb=256))
    taken = spare.start(other)
    assert below.instances[1].closed  # started for the old spec: closed, not reused
    assert taken is below.instances[2] and below.specs[2] == other
    assert spare.wait_ready(5)
    below.instances[3].close()  # died while waiting
    again = spare.start(other)
    assert again is below.instances[4]
    spare.close()


def test_a_spec_for_one_particular_sandbox_bypasses_the_spare() -> None:
    below = FakeBackend()
    spare = SpareBackend(below)
    spare.start(SandboxSpec(sandbox_id="sbx-given"))
    assert not spare.wait_ready(5) and len(below.instances) == 1


def test_closing_or_dropping_the_backend_closes_the_spare_and_starts_none() -> None:
    below = FakeBackend()
    spare = SpareBackend(below)
    spare.start(SandboxSpec())
    assert spare.wait_ready(5)
    spare.close()
    spare.close()
    assert below.instances[1].closed
    spare.start(SandboxSpec())
    assert not spare.wait_ready(5) and len(below.instances) == 3

    below = FakeBackend()
    dropped = SpareBackend(below)
    dropped.start(SandboxSpec())
    assert dropped.wait_ready(5)
    del dropped
    gc.collect()
    assert below.instances[1].closed


def test_a_failing_start_in_the_background_leaves_the_next_start_cold() -> None:
    class Failing(FakeBackend):
        fail = False

        def start(self, spec: SandboxSpec) -> FakeInstance:
            if self.fail:
                raise RuntimeError("no more sandboxes")
            return super().start(spec)

    below = Failing()
    spare = SpareBackend(below)
    spare.start(SandboxSpec())
    assert spare.wait_ready(5)
    below.fail = True
    spare.start(SandboxSpec())  # the spare, handed over; its successor fails quietly
    assert not spare.wait_ready(5)
    below.fail = False
    spare.start(SandboxSpec())
    assert len(below.instances) >= 3
    spare.close()
