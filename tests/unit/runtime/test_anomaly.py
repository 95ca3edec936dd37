from __future__ import annotations

from stockade.runtime.anomaly import (
    ActionRecord,
    AnomalyMonitor,
    Burst,
    CostSpike,
    OutputFlood,
    RepeatedDenials,
    RepeatedFailure,
)
from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import ManualClock
from stockade.runtime.events import AnomalyAction, AnomalyFlagged, BreakerState, RuntimeEvent
from stockade.runtime.killswitch import KillSwitch


def failing(fingerprint: str = "run_tests:{}") -> ActionRecord:
    return ActionRecord(subject="tool:run_tests", fingerprint=fingerprint, ok=False)


def test_the_same_failing_action_repeated_opens_its_breaker(
    clock: ManualClock, events: list[RuntimeEvent]
) -> None:
    breakers = Breakers(clock=clock)
    monitor = AnomalyMonitor(
        rules=[RepeatedFailure(times=3)], clock=clock, breakers=breakers, observer=events.append
    )
    assert monitor.observe(failing()) == ()
    monitor.observe(failing("run_tests:{other}"))
    monitor.observe(failing())
    (finding,) = monitor.observe(failing())
    assert finding.action is AnomalyAction.OPEN_BREAKER
    assert breakers.get("tool:run_tests").state is BreakerState.OPEN
    assert isinstance(events[0], AnomalyFlagged) and events[0].rule == "repeated_failure"


def test_a_burst_requires_approval_for_the_next_action(clock: ManualClock) -> None:
    monitor = AnomalyMonitor(rules=[Burst(actions=5, window_s=10)], clock=clock)
    for _ in range(5):
        assert monitor.observe(ActionRecord(subject="tool:x", fingerprint="x")) == ()
    (finding,) = monitor.observe(ActionRecord(subject="tool:x", fingerprint="x"))
    assert finding.rule == "burst"
    assert monitor.take_approval_reason() == "burst: 6 actions within 10s"
    assert monitor.take_approval_reason() is None


def test_a_rule_that_fired_stays_quiet_for_its_window(clock: ManualClock) -> None:
    monitor = AnomalyMonitor(rules=[Burst(actions=1, window_s=10)], clock=clock)
    monitor.observe(ActionRecord(subject="s", fingerprint="x"))
    assert len(monitor.observe(ActionRecord(subject="s", fingerprint="x"))) == 1
    assert monitor.observe(ActionRecord(subject="s", fingerprint="x")) == ()


def test_a_cost_spike_kills_the_run(clock: ManualClock) -> None:
    switch = KillSwitch("run-1")
    monitor = AnomalyMonitor(rules=[CostSpike(dollars=1.0, window_s=60)], clock=clock, kill_switch=switch)
    monitor.observe(ActionRecord(subject="model:m", fingerprint="m", dollars=0.6))
    clock.advance(61)
    monitor.observe(ActionRecord(subject="model:m", fingerprint="m", dollars=0.6))
    assert not switch.killed
    monitor.observe(ActionRecord(subject="model:m", fingerprint="m", dollars=0.6))
    assert switch.killed


def test_repeated_denied_attempts_are_flagged(clock: ManualClock) -> None:
    monitor = AnomalyMonitor(rules=[RepeatedDenials(times=3, action=AnomalyAction.WARN)], clock=clock)
    denied = ActionRecord(subject="tool:run_command", fingerprint="curl", denied=True)
    assert monitor.observe(denied) == monitor.observe(denied) == ()
    (finding,) = monitor.observe(denied)
    assert finding.rule == "repeated_denials" and finding.action is AnomalyAction.WARN


def test_an_output_flood_is_flagged(clock: ManualClock) -> None:
    monitor = AnomalyMonitor(rules=[OutputFlood(max_bytes=1000)], clock=clock)
    assert monitor.observe(ActionRecord(subject="s", fingerprint="a", output_bytes=900)) == ()
    assert (
        monitor.observe(ActionRecord(subject="s", fingerprint="a", output_bytes=200))[0].rule
        == "output_flood"
    )
