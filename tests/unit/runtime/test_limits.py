from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.models.pricing import Price
from stockade.runtime.clock import ManualClock
from stockade.runtime.events import LimitHit, RuntimeEvent
from stockade.runtime.limits import Budget, BudgetMeter, LocalWindow, RateLimit, SpendLimit, load_prices


def test_rate_limit_refuses_the_action_over_the_rolling_minute(
    clock: ManualClock, events: list[RuntimeEvent]
) -> None:
    limit = RateLimit(per_minute=3, window=LocalWindow(clock), observer=events.append)
    for _ in range(3):
        limit.acquire("run-1")
        clock.advance(10)
    with pytest.raises(exc.RateLimited) as refused:
        limit.acquire("run-1")
    assert refused.value.retryable
    assert refused.value.retry_after == pytest.approx(30.0)  # the first action leaves the window at t+60
    assert isinstance(events[0], LimitHit) and events[0].kind == "rate"
    clock.advance(30)
    limit.acquire("run-1")


def test_rate_limits_are_per_key(clock: ManualClock) -> None:
    limit = RateLimit(per_minute=1, window=LocalWindow(clock))
    limit.acquire("a")
    limit.acquire("b")
    with pytest.raises(exc.RateLimited):
        limit.acquire("a")


def test_spend_limit_stops_after_crossing_dollars_per_hour(
    clock: ManualClock, events: list[RuntimeEvent]
) -> None:
    spend = SpendLimit(dollars_per_hour=1.0, window=LocalWindow(clock), observer=events.append)
    spend.check()
    spend.record(0.6)
    clock.advance(600)
    with pytest.raises(exc.BudgetExceeded) as over:
        spend.record(0.6)  # already spent: counted, and the run must stop
    assert over.value.status == "budget" and over.value.kind == "dollars_per_hour"
    assert over.value.retry_after == pytest.approx(3000.0)
    with pytest.raises(exc.BudgetExceeded):
        spend.check()
    clock.advance(3000)  # the first $0.60 left the window
    spend.check()


def test_prices_are_editable(tmp_path: Path) -> None:
    table = tmp_path / "prices.toml"
    table.write_text('[models."my-local"]\ninput_per_mtok = 1.5\noutput_per_mtok = 3\n')
    prices = load_prices(table)
    assert prices["my-local"] == Price(input_per_mtok=1.5, output_per_mtok=3.0)
    assert "gpt-4.1" in prices
    table.write_text('[models."bad"]\ninput_per_mtok = "x"\n')
    with pytest.raises(exc.ConfigurationError, match=r"models\.bad"):
        load_prices(table)


def test_budget_counts_steps(clock: ManualClock) -> None:
    meter = BudgetMeter(budget=Budget(max_steps=2), clock=clock)
    meter.step()
    meter.step()
    with pytest.raises(exc.BudgetExceeded) as over:
        meter.step()
    assert over.value.kind == "steps" and meter.steps == 2


@pytest.mark.parametrize(
    ("budget", "use", "kind"),
    [
        (Budget(max_wall_s=60), lambda m, c: c.advance(60), "wall_time"),
        (Budget(max_tokens=1000), lambda m, c: m.charge(tokens=1000), "tokens"),
        (Budget(max_dollars=0.5), lambda m, c: m.charge(dollars=0.51), "dollars"),
    ],
)
def test_budget_ceilings(
    budget: Budget, use: Callable[[BudgetMeter, ManualClock], object], kind: str, clock: ManualClock
) -> None:
    meter = BudgetMeter(budget=budget, clock=clock)
    meter.check()
    use(meter, clock)
    with pytest.raises(exc.BudgetExceeded) as over:
        meter.check()
    assert over.value.kind == kind


def test_a_resumed_run_keeps_what_it_used(clock: ManualClock) -> None:
    meter = BudgetMeter(budget=Budget(max_wall_s=100, max_steps=5), clock=clock)
    meter.step()
    clock.advance(70)
    saved = meter.state()
    resumed = BudgetMeter.resume(Budget(max_wall_s=100, max_steps=5), saved, clock=ManualClock())
    assert resumed.steps == 1 and resumed.elapsed_s == pytest.approx(70)


@pytest.mark.parametrize("dollars", [float("nan"), float("inf"), 0.0])
def test_a_spend_limit_of_no_finite_amount_is_refused(dollars: float) -> None:
    with pytest.raises(exc.ConfigurationError, match="finite and > 0"):
        SpendLimit(dollars_per_hour=dollars)
