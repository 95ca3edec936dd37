"""A tiny stock-keeping module with one bug for the stockade demo to find and fix."""

from __future__ import annotations


def total_units(stock: dict[str, int]) -> int:
    """How many units there are in all."""
    return sum(stock.values())


def restock_needed(stock: dict[str, int], threshold: int) -> list[str]:
    """The items to reorder: those with ``threshold`` units or fewer, sorted by name."""
    return sorted(name for name, count in stock.items() if count < threshold)


def remove(stock: dict[str, int], name: str, units: int) -> dict[str, int]:
    """A new stock with ``units`` of ``name`` taken out; never below zero."""
    updated = dict(stock)
    updated[name] = max(updated.get(name, 0) - units, 0)
    return updated
