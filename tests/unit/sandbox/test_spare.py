"""SpareBackend: a start with the spec last asked for is the sandbox started ahead of it."""

from __future__ import annotations

import gc
import threading

from stockade.sandbox import SandboxSpec, SpareBackend
from stockade.testing import FakeBackend, FakeInstance
from stockade.types import Credential, Limits, NetworkPolicy
from tests.conftest import in_forked_child


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


def test_a_spec_with_egress_credentials_bypasses_the_spare() -> None:
    """The proxy reads the secret when the sandbox starts: a spare started before the secret
    rotated would be handed over holding the old one."""

    class Source:
        def read(self) -> str:
            return "TOKEN"

    api = Credential(name="api", hosts=("example.com",), source=Source())
    network = NetworkPolicy(allow_hosts=("example.com",), credentials=(api,))
    below = FakeBackend()
    spare = SpareBackend(below)
    spare.start(SandboxSpec(network=network))
    assert not spare.wait_ready(5) and len(below.instances) == 1  # no spare started for it
    spare.start(SandboxSpec(network=network))
    assert len(below.instances) == 2  # a cold start each time
    spare.close()


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


def test_a_forked_child_closes_at_once_and_starts_its_own_sandboxes() -> None:
    """The child's close hung for ever on the spare the parent was starting when it forked
    (no thread of the child ever ends that start): the spare is the parent's."""

    class Slow(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.starting, self.go = threading.Event(), threading.Event()

        def start(self, spec: SandboxSpec) -> FakeInstance:
            if threading.current_thread().name == "stockade-spare":
                self.starting.set()
                self.go.wait(10)
            return super().start(spec)

    below = Slow()
    spare = SpareBackend(below)
    spare.start(SandboxSpec())
    assert below.starting.wait(5)

    def child() -> object:
        spare.close()
        taken = spare.start(SandboxSpec())
        return [spare.wait_ready(), taken is below.instances[-1], len(below.instances)]

    assert in_forked_child(child) == [False, True, 2]  # a cold start of its own, no spare after
    below.go.set()
    assert spare.wait_ready(5)  # the parent's spare, started as before
    assert spare.start(SandboxSpec()) is below.instances[1]
    spare.close()
