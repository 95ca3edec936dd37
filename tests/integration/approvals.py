"""An approver for the tests of exec approvals: it keeps what the host was asked and says yes
to one argument, and the code that asks (``rm -r`` on each folder, from Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stockade.types import ExecRecord


@dataclass
class YesTo:
    """Approves an exec whose last argument is ``last``; ``asked`` holds every argv it saw."""

    last: str
    asked: list[tuple[str, ...]] = field(default_factory=list)

    def __call__(self, record: ExecRecord) -> bool:
        self.asked.append(record.argv)
        return record.argv[-1] == self.last


def remove_each(*folders: str) -> str:
    """``run_code`` source: ``rm -r`` on each folder in turn, its exit code, or ``'refused'``
    where the exec was refused (a refused exec raises PermissionError in the caller)."""
    return (
        "import subprocess\n"
        "def rm(d):\n"
        "    try:\n"
        "        return subprocess.run(['rm', '-r', d]).returncode\n"
        "    except PermissionError:\n"
        "        return 'refused'\n"
        f"[{', '.join(f'rm({folder!r})' for folder in folders)}]"
    )
