"""The supervisor's calls into libc: a failure raises, whatever the function's result type."""

from __future__ import annotations

import pytest

from stockade.sandbox.supervisor import libc

PR_GET_DUMPABLE = 3
NO_SUCH_OPTION = 0x7FFF_FFF0


def test_a_failed_prctl_raises() -> None:
    # prctl returns an int: its -1 read through a long was 4294967295, and a failed
    # PR_SET_NO_NEW_PRIVS or PR_SET_DUMPABLE went unnoticed
    with pytest.raises(OSError) as failed:
        libc.libc("prctl", NO_SUCH_OPTION, 0, 0, 0, 0)
    assert failed.value.errno == 22  # EINVAL


def test_a_prctl_that_works_returns_its_value() -> None:
    assert libc.libc("prctl", PR_GET_DUMPABLE, 0, 0, 0, 0) in (0, 1, 2)


def test_a_failed_syscall_raises_too() -> None:
    with pytest.raises(OSError):
        libc.libc("syscall", 100_000, 0)  # no such system call: ENOSYS
