"""What the command rules say of an exec: the strictest verdict over every name its program
goes by, and over what it runs besides its own file.

A program goes by the path it was run as, the file that path leads to, argv[0], and the
programs its content is a copy of (``execfiles``); an interpreter is also judged as the
module or script it runs, a loader or a multi-call binary as what it runs, and a script as
its interpreter run by the kernel (what each runs: ``execruns``); under an allowlist a file
is allowed only as the program it is listed as. ``ExecVerdicts`` is the base of the judge
(``execjudge``), whose round trip of a notification asks it for each verdict.
Standard library only.
"""

from __future__ import annotations

import os

import execfiles
import execrules
import execruns
from execfiles import ExecFiles
from execpaths import caller_path

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Set, Tuple


class ExecVerdicts(ExecFiles):
    """What the command rules say of an exec, by every name the program goes by."""

    def __init__(
        self,
        commands: "Dict[str, List[List[str]]]",
        sizes: "Dict[int, List[str]]",
        masked: "Sequence[Sequence[Any]]",
        listed: "Optional[Dict[str, List[str]]]",
    ) -> None:
        super().__init__(sizes, masked)
        self.commands = commands
        self._index = {kind: self._indexed(patterns) for kind, patterns in commands.items()}
        # Under an allowlist an exec is allowed by what its file is (device, inode): a link
        # the code made, /tmp/pip3 -> python3, is python3 by any name.
        self._listed: "Dict[Tuple[int, int], Set[str]]" = {}
        for file, names in (listed or {}).items():
            try:
                st = os.stat(file)
            except OSError:
                continue
            self._listed.setdefault((st.st_dev, st.st_ino), set()).update(names)
        self.carrying = False  # the exec judged last runs another program (execruns.carried)
        # rule -> the command it matched, as the judge found it runs (_by_names), for the exec
        # being judged: what a human is asked about, where the code chose the argv it shows
        self.found: "Dict[str, List[str]]" = {}

    @staticmethod
    def _indexed(patterns: "List[List[str]]") -> "Tuple[Dict[str, List[List[str]]], List[List[str]]]":
        """Patterns by their program's name, and those whose program is a glob."""
        literal: "Dict[str, List[List[str]]]" = {}
        globs: "List[List[str]]" = []
        for words in map(execrules.pattern, patterns):  # git-push x is git's: git push x
            if execruns.GLOB_CHARS & set(words[0]):
                globs.append(words)
            else:
                literal.setdefault(words[0], []).append(words)
        return literal, globs

    def _patterns(self, kind: str, name: str) -> "List[List[str]]":
        literal, globs = self._index[kind]
        found: "List[List[str]]" = []
        for filed in execrules.rule_names(name):  # pip3 -> pip, git-push -> git
            found += literal.get(filed, [])
            if globs:
                found += [w for w in globs if execruns.glob(filed, w[0])]
        return found

    def judge(
        self,
        pid: int,
        path: str,
        argv: "List[str]",
        st: "Optional[os.stat_result]" = None,
        depth: int = 0,
        *,
        listed: bool = True,
        interpreting: "Optional[str]" = None,
    ) -> "Tuple[str, Optional[str]]":
        """The strictest verdict over every name the program goes by: the path it was run as,
        the file that path leads to, the name it was given (argv[0]: a multi-call binary's
        applet), and the names of the programs its content is a copy of. An interpreter is
        also judged as the module or script it runs (``execruns.runs``: ``python3 -Im X``
        as X), and what a loader or a multi-call binary runs as what it is
        (``ld.so /bin/rm -r x`` as ``rm -r x``, ``busybox rm -r x`` as ``rm -r x``), and a
        script also as its interpreter with the argv the kernel gives it (``#!/bin/rm -r``).
        ``listed``: whether an allowlist judges it (a listed script's interpreter is not,
        as Landlock lets it run: only the deny and approve rules judge it). An interpreter's
        script file is judged as the file it is (``_scripts``), but for ``interpreting``:
        the script whose ``#!`` line runs this interpreter, which is being judged already."""
        target = self._in_view(pid, path)
        if st is None:
            st = os.stat(target)
        outside = not execruns.in_image(os.path.realpath(target))
        try:
            head, copies = self._read(target, st, outside)
        except OSError as exc:
            if outside:  # the kernel needs only x to run it: what it is must not go unread
                return _unreadable(exc)
            head, copies = b"", set()  # the image's: what it shipped, judged by its names
        real_name = self._real_name(target, st)
        if real_name is None:  # what the kernel will open cannot be told: nothing runs unjudged
            self.carrying = True  # a verdict on a race, not on the file: not kept
            return "deny", "changed: the file this exec names changed while it was judged"
        files = {os.path.basename(path), real_name} | copies
        listed_as = self._listed_as(st, argv) if listed and self.commands["allow"] else None
        verdict = self._by_names(files, argv, listed, listed_as)
        masked = copies & self._masked_names
        if masked and verdict[0] != "deny":  # masked: it runs under no name
            verdict = "deny", f"masked: a copy of {min(masked)}, which the rules let run under no name"
        script = execruns.interpreted(head, path, argv)
        if script is not None:  # the kernel runs its interpreter with no exec to judge
            if depth >= MAX_CARRIED:
                return TOO_DEEP
            # An interpreter outside the image can change while the script does not (by
            # "..", /usr/bin/../../tmp/x is outside it): its verdict is not kept.
            if not execruns.in_image(script[0]) or "/.." in script[0]:
                self.carrying = True
            carried_script = self._judge_carried(pid, *script, depth, listed=False, interpreting=path)
            verdict = _strictest(verdict, carried_script)
        verdict = _strictest(verdict, self._scripts(pid, files, argv, depth, interpreting))
        carried = execruns.carried(sorted(files), argv)
        if carried is None:
            return verdict
        if depth >= MAX_CARRIED:
            return TOO_DEEP
        self.carrying = True
        inner, inner_argv = carried
        if inner is None:  # an applet: the same file, by the applet's name (listed by it, or not)
            applet = execruns.program(inner_argv[0])
            applet_as = (
                ({applet} & self._listed.get(_file(st), set()), inner_argv[1:])
                if listed_as is not None
                else None
            )
            return _strictest(verdict, self._by_names({applet}, inner_argv, listed, applet_as))
        inner_verdict = self._judge_carried(
            pid, inner, inner_argv, depth, listed=listed, interpreting=interpreting
        )
        return _strictest(verdict, inner_verdict)

    def _scripts(
        self, pid: int, files: "Set[str]", argv: "List[str]", depth: int, interpreting: "Optional[str]"
    ) -> "Tuple[str, Optional[str]]":
        """The verdict on the script files an interpreter runs (``execruns.scripts``), each
        judged as the file it is, as if it were run itself: a link or a copy of a program
        a rule names (``python3 build/link-to-pip install``, ``node /usr/bin/npm install``)
        is that program, not the words of its path. Only the deny and approve rules judge
        it: the allowlist judges programs, and a script is read, not run."""
        found: "Dict[Tuple[int, str], List[str]]" = {}  # each a tail of argv: known by its length
        for name in sorted(files | ({os.path.basename(argv[0])} if argv else set())):
            try:
                candidates = execruns.scripts([name, *argv[1:]])
            except execruns.TooMany as error:
                return "deny", f"{error}, past what is judged"
            for s in candidates:
                if s[0] != interpreting:
                    found.setdefault((len(s), s[0]), s)
        verdict: "Tuple[str, Optional[str]]" = ("allow", None)
        for script in found.values():
            if depth >= MAX_CARRIED:
                return TOO_DEEP
            self.carrying = True  # another file, which can change while this one does not
            verdict = _strictest(verdict, self._judge_carried(pid, script[0], script, depth, listed=False))
            if verdict[0] == "deny":
                break
        return verdict

    def _judge_carried(
        self,
        pid: int,
        inner: str,
        argv: "List[str]",
        depth: int,
        *,
        listed: bool,
        interpreting: "Optional[str]" = None,
    ) -> "Tuple[str, Optional[str]]":
        """The verdict on the program an exec runs besides its own file (what a loader loads,
        a script's interpreter), opened from the caller's working folder if relative."""
        if not inner.startswith("/"):
            inner = f"/proc/{pid}/cwd/{inner}"
        try:
            return self.judge(pid, inner, argv, None, depth + 1, listed=listed, interpreting=interpreting)
        except OSError:  # it will not load: judged by its name all the same
            return self._by_names({os.path.basename(inner)}, argv, listed)

    def _by_names(
        self,
        files: "Set[str]",
        argv: "List[str]",
        listed: bool = True,
        listed_as: "Optional[Tuple[Set[str], List[str]]]" = None,
    ) -> "Tuple[str, Optional[str]]":
        """The verdict on ``argv`` run from a file that goes by ``files`` (``listed``: under
        the allowlist too, which allows it only as the program ``listed_as`` says it is, its
        names and arguments: ``_listed_as``; None, as none). The deny and approve rules judge
        it by every name: more names, stricter."""
        args = argv[1:]
        names = files | ({os.path.basename(argv[0])} if argv else set())
        candidates = [(name, args) for name in names]
        for name in names:  # by what the file is too, not argv[0] only (exec -a)
            # python3 -Impip x, python3 /usr/bin/pip x, python3 .../pip/__main__.py x: pip x
            try:
                commands = execruns.runs([name, *args])
            except execruns.TooMany as error:
                return "deny", f"{error}, past what is judged"
            for command in commands:
                candidates.append((os.path.basename(command[0]), command[1:]))
        refused = listed and self._allow_refuses(*(listed_as or (set(), args)))
        for kind, verdict in (("deny", "deny"), ("approve", "approve")):
            for name, rest in candidates:
                for words in self._patterns(kind, name):
                    if execrules.matches(words, [name, *rest]):
                        if verdict == "deny" or not refused:
                            rule = f"commands.{kind}: " + " ".join(words)
                            self.found.setdefault(rule, [name, *rest])
                            return verdict, rule
                        return "deny", "commands.allow"
        return ("deny", "commands.allow") if refused else ("allow", None)

    def _allow_refuses(self, names: "Set[str]", args: "List[str]") -> bool:
        """Under an allowlist, what the file is (never the name it was given: ``names``, those
        it is listed by) must be listed, and do what a rule names (``execrules.allows``: not
        merely carry its words)."""
        if not self.commands["allow"]:
            return False
        for name in names:
            if any(execrules.allows(words, [name, *args]) for words in self._patterns("allow", name)):
                return False
        return True

    def _listed_as(self, st: "os.stat_result", argv: "List[str]") -> "Tuple[Set[str], List[str]]":
        """What an allowlist may allow the file ``st`` as: the name it runs as of those it is
        listed by (a file of a program a rule names, found in the program folders or a listed
        program's helper folder: ``execrules.allowlisted``), which its argv[0] picks
        (``execrules.run_as``), and its arguments. A file listed by no name is no
        program a rule names, by whatever name it is run (a link the code made, /tmp/pip3 ->
        python3, or /tmp/ldd -> bash: ldd's interpreter, which runs only as ldd's), but for
        what env runs for a listed script (``_env_script``)."""
        names = self._listed.get(_file(st))
        if names:  # by the name it runs as: git-status's file given `git init` is git init
            return set(execrules.run_as(sorted(names), argv[0] if argv else "")), argv[1:]
        return self._env_script(st, argv) or (set(), argv[1:])

    def _env_script(self, st: "os.stat_result", argv: "List[str]") -> "Optional[Tuple[Set[str], List[str]]]":
        """A listed script run by the interpreter its ``#!/usr/bin/env X`` line names (npm's
        ``#!/usr/bin/env node``): env execs X (``st``, found in the program folders) with
        argv ``[X, *options, script, *args]``, which is judged as the script run with
        ``args``. Only a script reached by a path of the image (which code cannot change
        between this look and the interpreter's open): its names and ``args``; None else."""
        for at in range(1, min(len(argv), MAX_ENV_WORDS + 2)):
            script = argv[at]
            if not execruns.in_image(script) or "/." in script:
                continue
            try:
                if not execruns.in_image(os.path.realpath(script)):
                    continue
                names = self._listed.get(_file(os.stat(script)))
                runs = execruns.env_runs(execfiles.read_head(script)) if names else None
            except OSError:
                continue
            if names and runs is not None and argv[1:at] == runs[1:] and self._is_program(st, runs[0]):
                return set(names), argv[at + 1 :]
        return None

    @staticmethod
    def _is_program(st: "os.stat_result", name: str) -> bool:
        """Whether the file ``st`` is the program ``name`` of the program folders (as env
        finds it on PATH), or at ``name`` where it is a path."""
        places = (
            [name] if name.startswith("/") else [f"{folder}/{name}" for folder in execrules.ALLOW_FOLDERS]
        )
        for place in places:
            try:
                if _file(os.stat(place)) == _file(st):
                    return True
            except OSError:
                continue
        return False

    @staticmethod
    def _in_view(pid: int, path: str) -> str:
        """``path`` as the caller resolves it. /proc/self is the caller's, not ours, and so
        is any link that leads there (/dev/fd/N, /dev/stdin, one the code made): the links
        on the way are followed here, each one into /proc/self going to /proc/PID, and once
        in /proc/PID what is left is the kernel's to follow (its links are the caller's)."""
        return caller_path(pid, path)


# How deep what an exec runs besides its file is followed (a script's interpreter, a loader's
# program: ld.so ld.so ... rm), past the kernel's own depth for scripts (five: with four here,
# a chain of five scripts ran its last interpreter, `#!/usr/bin/rm -r`, unjudged). Deeper:
# refused, never let through unread.
MAX_CARRIED = 8
TOO_DEEP = ("deny", f"more than {MAX_CARRIED} scripts or loaders in one exec, past what is judged")
STRICTNESS = {"allow": 0, "approve": 1, "deny": 2}


def _strictest(
    one: "Tuple[str, Optional[str]]", other: "Tuple[str, Optional[str]]"
) -> "Tuple[str, Optional[str]]":
    return other if STRICTNESS[other[0]] > STRICTNESS[one[0]] else one


def _unreadable(exc: OSError) -> "Tuple[str, Optional[str]]":
    """The verdict on a file outside the image the judge cannot read as it needs to (no read
    right: the kernel runs a file of mode 0111, and a script's interpreter too; a lease the
    code holds; a short read): refused, never let through unread."""
    why = exc.strerror or str(exc)
    return "deny", f"unreadable: the exec judge cannot read this file ({why}) and runs none unread"


# The options an env shebang may give its interpreter (``#!/usr/bin/env -S node --x``) that
# are looked past for the script's path (ExecVerdicts._env_script).
MAX_ENV_WORDS = 8


def _file(st: "os.stat_result") -> "Tuple[int, int]":
    return st.st_dev, st.st_ino
