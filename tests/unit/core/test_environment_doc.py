"""Every ``STOCKADE_*`` variable the code, the scripts or the tests' configuration read is in the
one table of docs/environment.md, and the table lists no variable nothing reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[3]
NAME = re.compile(r"\bSTOCKADE_[A-Z][A-Z0-9_]*\b")
# Set by a test for its own sandbox to find, not a setting.
INTERNAL = {"STOCKADE_TEST_HOST_SECRET"}


def _read_by_the_project() -> set[str]:
    found: set[str] = set()
    for folder in ("src", "scripts", "tests", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", "") and path != Path(__file__):
                found |= set(NAME.findall(path.read_text(errors="replace")))
    return found - INTERNAL


def test_the_environment_table_lists_every_variable_and_only_those() -> None:
    documented = set(NAME.findall((ROOT / "docs" / "environment.md").read_text()))
    read = _read_by_the_project()
    assert sorted(read - documented) == [], "read but not documented"
    assert sorted(documented - read) == [], "documented but read by nothing"
