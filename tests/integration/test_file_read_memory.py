"""What a file read costs the host: about the result, not a copy of it per step.

A read comes in chunks; gathered into a list and joined, the file is held twice (and three
times as text, the decoded string beside both). Each read runs in a fresh process, so that the
peak it raises is its own; the file is sparse, so the sandbox's memory limit bounds nothing
here: only the host's handling does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.sandbox._transfers import TRANSFER_CHUNK
from tests.conftest import require_tier

pytestmark = [pytest.mark.process]

CHILD = Path(__file__).with_name("read_child.py")
REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
# What a read holds besides its result, whatever the file's size: the chunk in transit, as
# the channel receives it, frames it and hands it over, and what the allocator keeps of
# chunks freed (about ten MiB, measured).
IN_TRANSIT = 6 * TRANSFER_CHUNK


def grown_by_read(size: int, form: str) -> int:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    argv = [sys.executable, str(CHILD), str(size), form]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    grown: int = json.loads(done.stdout)["grown"]
    return grown


@pytest.mark.parametrize(("form", "copies"), [("bytes", 1), ("range", 1), ("text", 2)])
def test_a_read_holds_its_result_once(form: str, copies: int) -> None:
    # bytes: the file once; text: the bytes and the string decoded from them (ASCII: as long)
    require_tier("process")
    size = 128 * MiB
    grown = grown_by_read(size, form)
    assert grown < copies * size + IN_TRANSIT, (
        f"a {form} read of {size // MiB} MiB raised the host's peak by {grown / MiB:.0f} MiB"
    )
