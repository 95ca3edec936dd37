"""The outcomes of the calls that run code: a command's (``CommandResult``) and ``run_code``'s
(``Execution``, with its ``Result``s, ``Logs`` and ``ExecutionError``).

Apart because these are what a call gives back, read by every layer above the sandbox.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stockade.types._rules import ExecRecord


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """The outcome of one command. A non-zero exit is a result, never an exception.

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced); ``stdout_bytes`` and
    ``stderr_bytes`` are the true sizes produced, even when ``truncated``.
    ``signal`` is set when the process was killed by one. ``oom_killed``: the command was
    killed by the memory limit (or for thrashing at it): it died of a SIGKILL while the
    sandbox's count of such kills rose, not only beside another call's; ``locks_killed``: for
    holding more file locks than a sandbox may (4,096: kernel memory no memory limit counts).
    """

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    locks_killed: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    signal: int | None = None
    execs: tuple[ExecRecord, ...] = ()  # what the sandbox's rules judged (with SandboxRules)
    execs_omitted: int = 0  # execs past what a report keeps (its count, then its bytes)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Result:
    """One displayable value: a MIME bundle such as ``{"text/plain": "42"}``.

    Binary types (``image/png``) are base64 text, as in Jupyter.
    """

    data: Mapping[str, str]

    @property
    def text(self) -> str | None:
        return self.data.get("text/plain")

    @property
    def png(self) -> str | None:
        return self.data.get("image/png")

    @property
    def html(self) -> str | None:
        return self.data.get("text/html")


@dataclass(frozen=True, kw_only=True)
class ExecutionError:
    """An exception raised by the executed code (not by stockade)."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True, kw_only=True)
class Logs:
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True, kw_only=True)
class Execution:
    """The outcome of ``run_code``: displayed results, printed logs, and the error if any."""

    results: tuple[Result, ...] = ()
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    duration_s: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    execs: tuple[ExecRecord, ...] = ()  # what the sandbox's rules judged (with SandboxRules)
    execs_omitted: int = 0  # execs past what a report keeps (its count, then its bytes)

    @property
    def text(self) -> str | None:
        """The text of the last result (the trailing expression's value), if any."""
        for result in reversed(self.results):
            if result.text is not None:
                return result.text
        return None
