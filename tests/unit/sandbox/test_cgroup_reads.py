"""Reading a sandbox's cgroup while another process removes it.

A group is removed only once it is empty; while its creator takes it down, the kernel answers
a read of its files with ENODEV (the folder is still there, its files no longer serve). The
garbage collection of another process (each process collects at its first sandbox's start)
reads groups it does not own at any instant of that, and must take such a group for empty,
never fail the start it runs in. The kernel's answer is injected here: the instant is
microseconds wide on a real host (the project's CI met it once, in a durable-run test)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from stockade.sandbox._cgroups import Cgroup
from stockade.types import Mechanism


def _procs_answer(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    read_text = Path.read_text

    def answer(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "cgroup.procs":
            raise OSError(code, os.strerror(code), str(self))
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", answer)


@pytest.mark.parametrize("mechanism", [Mechanism.CGROUP_V1, Mechanism.CGROUP_V2])
def test_a_group_being_removed_reads_as_empty(monkeypatch: pytest.MonkeyPatch, mechanism: Mechanism) -> None:
    group = Cgroup(mechanism, "sbx-being-removed", create=False)
    _procs_answer(monkeypatch, errno.ENODEV)
    assert group.pids() == []


def test_any_other_failure_to_read_a_group_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    group = Cgroup(Mechanism.CGROUP_V1, "sbx-unreadable", create=False)
    _procs_answer(monkeypatch, errno.EACCES)
    with pytest.raises(PermissionError):
        group.pids()
