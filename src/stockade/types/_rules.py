"""What the sandbox itself enforces of a policy (``SandboxRules``, ``ReadOnly``) and the execs
it judged by them (``ExecRecord``, ``JudgedExecs``).

Apart because these rules are judged inside the sandbox, at each exec and by the kernel,
where the other values are the host's.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from stockade._checks import check_strings
from stockade._globs import workspace_globs
from stockade.exceptions import InvalidArgument


@dataclass(frozen=True, kw_only=True)
class ReadOnly:
    """Workspace paths (globs) code may read but never change, whatever ``write`` grants:
    a data class the role may read and not write. ``setting`` names the rule they come from
    (a refusal names it)."""

    paths: tuple[str, ...]
    setting: str = "read_only"


@dataclass(frozen=True, kw_only=True)
class SandboxRules:
    """What the sandbox itself enforces of a policy, whatever code runs in it and by what route.

    ``deny``, ``approve`` and ``allow`` are command patterns (``"curl"``, ``"rm -r"``,
    ``"git push"``), judged at every exec inside the sandbox with the argv the kernel was
    given: denied, it fails (exit 126, ``denied by policy: RULE`` on its stderr); to be
    approved, it waits at its exec while the host asks the sandbox's ``approver``. A
    non-empty ``allow`` lets only what it names run (its words where the program reads them:
    python's module or script, git's command, the leading operands; not an option's value),
    and nothing in a writable place can be executed. A program denied whatever its arguments
    is also masked: it cannot be read, copied or run under any name. ``write`` names the
    workspace paths code may change (``dir/**``, ``dir``, a file; ``**`` is everything): the
    rest of the workspace is read-only to code, by the kernel. Only what ``read`` names, and
    nothing ``hide`` names, enters the sandbox when a folder seeds it: what the rules do not
    let the run read is not there to be read, by any program. Each of ``read_only`` must
    stay read-only to code: Landlock grants whole folders and cannot take a part of a written
    one back, so where one of its globs may match beneath a ``write`` target (``src/data/**``
    under ``src/**``, anything under ``**``) the sandbox refuses (``LimitNotEnforceable``,
    naming its ``setting``) unless the caller accepts less; elsewhere the kernel holds it.
    ``write``, ``read`` and ``hide`` are workspace globs, kept normalised (``./a``,
    ``/workspace/a`` and ``a//b`` are ``a`` and ``a/b``); one that climbs (``..``) or names
    another absolute path is an ``InvalidArgument``.
    """

    deny: tuple[str, ...] = ()
    approve: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    write: tuple[str, ...] = ("**",)
    read: tuple[str, ...] = ("**",)
    hide: tuple[str, ...] = ()
    read_only: tuple[ReadOnly, ...] = ()

    def __post_init__(self) -> None:
        for name in ("write", "read", "hide"):  # matched in one form, whatever the spelling
            globs = check_strings(getattr(self, name), argument=f"SandboxRules.{name}")
            object.__setattr__(self, name, workspace_globs(globs, setting=f"SandboxRules.{name}"))
        for name in ("deny", "approve", "allow"):
            # checked as a policy file's are: a str read a character at a time judged nothing,
            # and shlex.split(None) read the host's stdin
            argument = f"SandboxRules.{name}"
            patterns = check_strings(getattr(self, name), argument=argument)
            for pattern in patterns:
                try:
                    words = shlex.split(pattern)
                except ValueError as err:
                    raise InvalidArgument(
                        f"{argument}: {pattern!r} is not valid shell words: {err}", argument=argument
                    ) from None
                if not words:
                    raise InvalidArgument(f"{argument}: a command pattern cannot be empty", argument=argument)
            object.__setattr__(self, name, patterns)

    @property
    def judges_execs(self) -> bool:
        return bool(self.deny or self.approve or self.allow)

    @property
    def confines_writes(self) -> bool:
        return "**" not in (w.strip("/") for w in self.write)

    @property
    def judges_paths(self) -> bool:
        """Rules over the workspace's paths: then a files call never follows a symbolic link
        (the path it names is the one judged)."""
        return self.confines_writes or bool(self.hide) or "**" not in (r.strip("/") for r in self.read)


@dataclass(frozen=True, kw_only=True)
class ExecRecord:
    """One exec the sandbox judged: the program run, its argv, and the verdict.

    ``verdict`` is ``"allow"``, ``"deny"``, ``"approve"`` (a human said yes) or ``"refuse"``
    (a human said no, or nobody could be asked); ``rule`` names the rule that decided.
    ``own_code``, on an exec the host is asked to approve: nothing but the code of the call
    it is credited to can have started it (a command's own processes, or the first
    ``run_code`` in a new interpreter), so an approval of that call may answer for it.
    ``between``: no call's code ran it; what an earlier call left running did (a thread of
    the interpreter, a child), after that call returned. Such execs are listed first in the
    next call's ``execs`` (or taken with ``TakeExecs``); one needing an approval was refused,
    with no call to ask under. ``runs``, on an exec the host is asked to approve: the command
    the rule matched, as the judge found it runs, where that is not ``argv`` (the code
    chooses argv: ``exec -a true rm -r x`` runs ``rm -r x``, as does a copy of rm named
    true, or a script whose ``#!`` line is ``/bin/rm -r``). ``file``: the file that ran, where
    ``path`` led to another through links (a link the code made, ``/tmp/pip3`` to
    ``/usr/bin/python3.11``; the image's own, ``/bin/sh`` to ``dash``); empty where it is
    ``path`` itself.
    """

    path: str
    argv: tuple[str, ...]
    verdict: str
    rule: str = ""
    own_code: bool = False
    between: bool = False
    runs: tuple[str, ...] = ()
    file: str = ""


@dataclass(frozen=True, kw_only=True)
class JudgedExecs:
    """The execs judged while no call ran that no call's result listed yet (``TakeExecs``):
    each ``ExecRecord.between``; ``execs_omitted`` counts those past what a report keeps."""

    execs: tuple[ExecRecord, ...] = ()
    execs_omitted: int = 0
