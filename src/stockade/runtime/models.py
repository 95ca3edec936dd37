"""Runtime controls around a ``Model``: wrappers, never flags.

model = LimitedModel(BreakerModel(RetryingModel(resolve_model("openai:gpt-4.1"), retrier), breakers),
                     spend=SpendLimit(dollars_per_hour=5), meter=meter)
"""

from __future__ import annotations

from collections.abc import Mapping

from stockade.exceptions import ModelError
from stockade.models.base import Model, WrapperModel, counted_usage
from stockade.models.messages import ModelRequest, ModelResponse
from stockade.models.pricing import DEFAULT_PRICES, Price, cost_usd
from stockade.runtime.breaker import Breakers
from stockade.runtime.clock import Clock, SystemClock
from stockade.runtime.events import Observer
from stockade.runtime.killswitch import check_watched
from stockade.runtime.limits import BudgetMeter, LimitGate, OnLimit, RateLimit, SpendLimit
from stockade.runtime.retry import Retrier

__all__ = ["BreakerModel", "LimitedModel", "RetryingModel"]


class RetryingModel(WrapperModel):
    """Provider 429/5xx and connection failures are retried (``retry_after`` honoured)."""

    def __init__(self, wrapped: Model, retrier: Retrier) -> None:
        super().__init__(wrapped)
        self.retrier = retrier

    async def request(self, request: ModelRequest) -> ModelResponse:
        return await self.retrier.acall(f"model:{self.name}", lambda: self.wrapped.request(request))


def _model_failure(err: BaseException) -> bool:
    return isinstance(err, ModelError | ConnectionError | TimeoutError)


class BreakerModel(WrapperModel):
    """The breaker ``model:<name>``: a provider that keeps failing is not called for a while."""

    def __init__(self, wrapped: Model, breakers: Breakers) -> None:
        super().__init__(wrapped)
        self.breaker = breakers.get(f"model:{wrapped.name}")

    async def request(self, request: ModelRequest) -> ModelResponse:
        return await self.breaker.acall(lambda: self.wrapped.request(request), error_counts=_model_failure)


class LimitedModel(WrapperModel):
    """Holds a request back while the spend limit, the rate limit or the run's budget says so,
    and charges each response's tokens and dollars (from ``prices``) to them. ``key`` scopes the
    shared limits (a tenant, a user, "global").

    A full window stops the run (``on_spend_limit``, default "stop": ``BudgetExceeded``) or
    waits until it frees up ("wait"; a kill switch watched in this context still stops the
    wait); requests over ``rate`` wait by default. A wait longer than ``wait_in_place_s`` stops
    the run resumable instead (``LimitWait``). The check comes before the request: a
    response that was paid for is always used, never thrown away."""

    def __init__(
        self,
        wrapped: Model,
        *,
        rate: RateLimit | None = None,
        spend: SpendLimit | None = None,
        meter: BudgetMeter | None = None,
        prices: Mapping[str, Price] = DEFAULT_PRICES,
        key: str = "global",
        on_spend_limit: OnLimit = OnLimit.STOP,
        on_rate_limit: OnLimit = OnLimit.WAIT,
        wait_in_place_s: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(wrapped)
        self.rate = rate
        self.spend = spend
        self.meter = meter
        self.prices = prices
        self.key = key
        self.on_spend_limit = OnLimit(on_spend_limit)
        self.on_rate_limit = OnLimit(on_rate_limit)
        self.wait_in_place_s = wait_in_place_s
        self.clock = clock or SystemClock()

    def _gate(self, on_limit: OnLimit, observer: Observer) -> LimitGate:
        return LimitGate(
            on_limit=on_limit, clock=self.clock, observer=observer, wait_in_place_s=self.wait_in_place_s
        )

    async def request(self, request: ModelRequest) -> ModelResponse:
        if self.meter is not None:
            self.meter.check()
        spend, rate, key = self.spend, self.rate, self.key
        if spend is not None:
            await self._gate(self.on_spend_limit, spend.observer).admit(
                kind="spend",
                key=key,
                probe=lambda: spend.peek(key),
                describe=lambda verdict: spend.describe(key, verdict),
                interrupted=check_watched,
            )
        if rate is not None:
            await self._gate(self.on_rate_limit, rate.observer).admit(
                kind="rate",
                key=key,
                probe=lambda: rate.take(key),
                describe=lambda _: rate.describe(key),
                interrupted=check_watched,
            )
        response = await self.wrapped.request(request)
        response = response.model_copy(update={"usage": counted_usage(request, response)})
        dollars = cost_usd(response.model_name or self.name, response.usage, self.prices)
        if self.meter is not None:
            self.meter.charge(tokens=response.usage.total_tokens, dollars=dollars)
        if spend is not None:
            spend.charge(dollars, key)
        return response
