"""One file read in a process of its own, for ``test_file_read_memory``: how far the read
raised this process's peak resident memory, as JSON.

    python read_child.py SIZE FORMAT     (FORMAT: bytes, text or range)

The file is sparse (SIZE bytes, one of them written): it costs the sandbox nothing, the host
what it holds of it."""

from __future__ import annotations

import json
import resource
import sys

from stockade import Limits, Sandbox

size, form = int(sys.argv[1]), sys.argv[2]


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


with Sandbox.create(tier="process", limits=Limits(memory_mb=128)) as sbx:
    made = sbx.commands.run(f"truncate -s {size - 1} sparse && printf a >> sparse")
    assert made.exit_code == 0, made.stderr
    sbx.files.read_range("sparse", 0, 1)  # a read's own first costs (imports), not counted
    before = peak()
    if form == "range":
        data: str | bytes = sbx.files.read_range("sparse", 0, size)
    else:
        data = sbx.files.read("sparse", format="text" if form == "text" else "bytes")
    grown = peak() - before
    assert len(data) == size and data[-1:] in ("a", b"a")
print(json.dumps({"grown": grown}))
