"""Tests of inventory.py; they run under pytest and under ``python3 -m unittest`` alike."""

from __future__ import annotations

import unittest

from inventory import remove, restock_needed, total_units


class InventoryTests(unittest.TestCase):
    def test_total_units(self) -> None:
        self.assertEqual(total_units({"bolts": 3, "nuts": 4}), 7)

    def test_restock_includes_items_at_the_threshold(self) -> None:
        stock = {"bolts": 2, "nuts": 10, "washers": 5}
        self.assertEqual(restock_needed(stock, threshold=5), ["bolts", "washers"])

    def test_remove_never_goes_below_zero(self) -> None:
        self.assertEqual(remove({"bolts": 2}, "bolts", 5), {"bolts": 0})


if __name__ == "__main__":
    unittest.main()
