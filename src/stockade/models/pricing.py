"""Token prices, to turn usage into dollars. A plain table the user can replace or extend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stockade.models.messages import Usage

__all__ = ["DEFAULT_PRICES", "Price", "cost_usd"]


@dataclass(frozen=True, kw_only=True)
class Price:
    """US dollars per million tokens."""

    input_per_mtok: float
    output_per_mtok: float


# Public list prices at the time of writing; edit or pass your own table.
DEFAULT_PRICES: Mapping[str, Price] = {
    "gpt-4.1": Price(input_per_mtok=2.00, output_per_mtok=8.00),
    "gpt-4.1-mini": Price(input_per_mtok=0.40, output_per_mtok=1.60),
    "gpt-4.1-nano": Price(input_per_mtok=0.10, output_per_mtok=0.40),
    "gpt-4o": Price(input_per_mtok=2.50, output_per_mtok=10.00),
    "gpt-4o-mini": Price(input_per_mtok=0.15, output_per_mtok=0.60),
    "claude-sonnet-4-5": Price(input_per_mtok=3.00, output_per_mtok=15.00),
    "claude-sonnet-4": Price(input_per_mtok=3.00, output_per_mtok=15.00),
    "claude-opus-4-1": Price(input_per_mtok=15.00, output_per_mtok=75.00),
    "claude-haiku-4-5": Price(input_per_mtok=1.00, output_per_mtok=5.00),
    "claude-3-5-haiku": Price(input_per_mtok=0.80, output_per_mtok=4.00),
}


def cost_usd(model_name: str, usage: Usage, prices: Mapping[str, Price] = DEFAULT_PRICES) -> float:
    """The cost of ``usage``; unknown models (local servers, scripted) cost 0.

    A dated name (``gpt-4.1-2025-04-14``) falls back to its longest listed prefix.
    """
    price = prices.get(model_name)
    if price is None:
        matches = [name for name in prices if model_name.startswith(name)]
        price = prices[max(matches, key=len)] if matches else None
    if price is None:
        return 0.0
    return (usage.input_tokens * price.input_per_mtok + usage.output_tokens * price.output_per_mtok) / 1e6
