"""The reset's settings baseline (supervisor/baseline.py) over a stand-in for /proc/sys.

The first reset walks all of it for writable sysctls the start did not record (a tier whose
namespaces expose more is replaced); later resets read only the recorded ones, since what is
writable cannot change within a sandbox's life."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stockade.sandbox.supervisor import baseline


def _tree(root: Path) -> dict[str, str]:
    (root / "kernel").mkdir(parents=True)
    recorded = {
        str(root / "kernel" / "msgmnb"): "16384\n",
        str(root / "kernel" / "sem"): "32000\t1024\t500\n",
    }
    for path, value in recorded.items():
        Path(path).write_text(value)
    return recorded


def _base(recorded: dict[str, str]) -> dict[str, Any]:
    base = baseline.snapshot()
    base["sysctls"] = dict(recorded)
    return base


def test_the_first_reset_walks_everything_later_ones_read_the_recorded(tmp_path: Path) -> None:
    recorded = _tree(tmp_path)
    base = _base(recorded)
    msgmnb = Path(next(iter(recorded)))
    msgmnb.write_text("17\n")  # a user's change
    assert baseline.restore(base, sysctl_root=str(tmp_path)) == []
    assert base["sysctls_walked"] and msgmnb.read_text() == "16384\n"
    msgmnb.write_text("18\n")  # the next user's, put back by reading the recorded ones only
    (tmp_path / "kernel" / "new").write_text("1\n")  # never walked for again
    assert baseline.restore(base, sysctl_root=str(tmp_path)) == []
    assert msgmnb.read_text() == "16384\n"


def test_a_writable_sysctl_the_start_did_not_record_fails_the_reset(tmp_path: Path) -> None:
    recorded = _tree(tmp_path)
    base = _base(recorded)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "somaxconn").write_text("4096\n")
    problems = baseline.restore(base, sysctl_root=str(tmp_path))
    assert problems == [f"{tmp_path}/net/somaxconn is writable and was not recorded at start-up"]
    assert not base["sysctls_walked"], "the next reset walks again (and fails again)"
    assert baseline.restore(base, sysctl_root=str(tmp_path)) == problems
