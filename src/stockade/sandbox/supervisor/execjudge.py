"""The exec judge in Python: each exec that reaches the supervisor, judged and answered.

The supervisor judges each exec here (``on_exec``) with the argv the kernel was given,
records it on the job whose code ran it, and answers: run, or fail with EPERM and a line on
the program's stderr. An exec that needs approval waits while the host asks (``approve``
frames); the host's answer comes back as a ``verdict`` request (``on_verdict``).

Loaded at the first exec that reaches Python (``rules.Rules.python_judge``): where the
compiled judge runs, most sandboxes never need it, and a start need not import it.
Standard library only.
"""

from __future__ import annotations

import os

import confine
import execrules
import execruns
from execrules import build_id
from protocol import MAX_EXEC_ARGV
from rules import E2BIG, ENOENT, EPERM, kept_argv, record

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Set, Tuple


# Of an argv past MAX_EXEC_ARGV words, what is shown besides its head: its last words (an
# exec's targets: `rm <62 files> -r /workspace/src` was asked as its 63 first words, the `-r`
# and the folder unseen), and at most this many words a rule matched it by.
SHOWN_TAIL = 16
SHOWN_MATCHED = 16


def shown_argv(argv: "list[str]", matched: "Sequence[str]" = ()) -> "list[str]":
    """What a record and an approval carry of ``argv``: all of it up to MAX_EXEC_ARGV words,
    else its first word, the words a rule matched it by (``matched``: the first argument
    that is each, ``execrules.judged_words``), its last SHOWN_TAIL words and as much of its
    head as fits, each stretch left out shown as one word naming how many words it holds
    and the SHA-256 of the whole argv (each word as ``kept_argv`` keeps it). An approval
    asked with the first 64 words only was the same request (the same id, so the same
    decision) as another exec with those words and any others after them, and showed
    neither the flag the rule judged nor the exec's targets."""
    if len(argv) <= MAX_EXEC_ARGV:
        return kept_argv(list(argv))
    import hashlib

    keep = set(range(len(argv) - SHOWN_TAIL, len(argv))) | {0}
    wanted = list(dict.fromkeys(matched))[:SHOWN_MATCHED]
    for word in wanted:
        at = next((i for i in range(1, len(argv)) if argv[i] == word), None)
        if at is not None:
            keep.add(at)
    for at in range(1, len(argv)):  # the head, while it and the marks of the gaps fit
        if at not in keep and _shown_count(keep | {at}) > MAX_EXEC_ARGV:
            break
        keep.add(at)
    whole = hashlib.sha256("\0".join(argv).encode("utf-8", "surrogateescape")).hexdigest()
    shown: "list[str]" = []
    last = -1
    for at in sorted(keep):
        if at > last + 1:
            shown.append(f"[... {at - last - 1} words not shown; the whole argv is sha256 {whole}]")
        shown.append(argv[at])
        last = at
    return kept_argv(shown)


def _shown_count(keep: "Set[int]") -> int:
    """The words shown for the indexes ``keep`` (0 among them): each, and a mark a gap."""
    ordered = sorted(keep)
    return len(ordered) + sum(1 for at in range(1, len(ordered)) if ordered[at] > ordered[at - 1] + 1)


class ExecJudge:
    """What the command rules say of an exec, by every name the program goes by, and the
    round trip of one notification (read, judge, answer, record)."""

    def __init__(
        self,
        sup: "Any",
        commands: "Dict[str, List[List[str]]]",
        sizes: "Dict[int, List[str]]",
        approver: bool = False,
        masked: "Sequence[Sequence[Any]]" = (),
        *,
        listed: "Optional[Dict[str, List[str]]]" = None,
    ) -> None:
        """``masked``: what the host read of the programs the tier masks before they were
        masked (``_rules_programs.masked_identities``): [names, size, sha256, build ID in hex].
        ``listed``: under an allowlist, the files of the programs it names and the names
        each is listed by (``rulespy.allowlist``)."""
        self.sup = sup
        self.commands = commands
        self.approver = approver
        # a rule as a record names it (as written, or as matched: `npm i` is `npm install`)
        # -> its words (what an argv cut must show: shown_argv)
        self._rules = {
            f"commands.{kind}: " + " ".join(form): words
            for kind, patterns in commands.items()
            for words in patterns
            for form in (words, execrules.pattern(words))
        }
        # A masked program can be read by no one here, so what it is comes from the host: a
        # copy of one (from the seed, an upload, the network) is that program.
        self._masked: "Dict[int, Dict[str, Set[str]]]" = {}  # size -> sha256 -> names
        self._masked_builds: "Dict[bytes, Set[str]]" = {}
        self._masked_names: "Set[str]" = set()
        for names, size, digest, build in masked:
            if int(size) > 0:  # an empty file is a copy of nothing
                self._masked.setdefault(int(size), {}).setdefault(str(digest), set()).update(names)
            if build:
                self._masked_builds.setdefault(bytes.fromhex(build), set()).update(names)
            self._masked_names.update(names)
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
        self._names: "Dict[Tuple[int, int, int], str]" = {}  # file -> the name it has
        # What is kept of a file's content is kept by its stamp (_stamp: its ctime among
        # them, which every change moves and no process can set back), and only once settled.
        self._identity: "Dict[Tuple[int, ...], str]" = {}  # stamp -> digest
        self._sizes = sizes  # size -> paths of the programs rules name (rulespy.program_sizes)
        self.pending: "Dict[int, Tuple[int, int, int, Any, Dict[str, Any], Tuple[Any, ...]]]" = {}
        self.requests = 0
        # (pid, file, argv) -> the refusal: the same exec again by another name (a PATH
        # search's next folder) is refused as it was. Refusals only: an allow kept so let a
        # script that rewrote itself run as what it became, unjudged and unrecorded.
        self._refused: "Dict[Tuple[Any, ...], Tuple[str, Optional[str]]]" = {}
        self.carrying = False  # the exec judged last runs another program (execruns.carried)
        self._builds: "Dict[Tuple[int, ...], Optional[bytes]]" = {}  # stamp -> ELF build ID
        self._program_builds: "Optional[Dict[bytes, Set[str]]]" = None  # build ID -> rule programs
        # (path, the file's stamp, argv) -> the judge's verdict and rule
        self._verdicts: "Dict[Tuple[Any, ...], Tuple[str, Optional[str]]]" = {}
        # rule -> the command it matched, as the judge found it runs (_by_names), for the exec
        # being judged: what a human is asked about, where the code chose the argv it shows
        self.found: "Dict[str, List[str]]" = {}

    # -- one notification -------------------------------------------------------------------

    def on_exec(self, listener: int, got: "Tuple[int, int, int, Tuple[int, ...]]") -> None:
        """The caller waits in the kernel meanwhile, so an allowed exec is answered as soon as
        its verdict and job are known, and recorded after: the argv recorded is the one
        judged, read before. The job is looked up first, as the caller may have run, ended
        and been reaped by the time the record is made."""
        nid, pid, nr, args = got
        try:
            mem = confine.open_memory(listener, nid, pid)
        except OSError:
            confine.answer(listener, nid, False)  # gone, or cannot tell what it runs: no
            return
        try:
            path = exec_path(pid, confine.read_path(mem, pid, nr, args))
            target = self._in_view(pid, path)
            try:
                st = os.stat(target)
            except OSError:
                # What the kernel would say (a PATH search goes on to the next folder). Never
                # "go on" unjudged: the file could appear between this look and the exec.
                # Nothing runs, nothing is recorded: its argv need not be read.
                confine.answer(listener, nid, False, ENOENT)
                return
            argv = confine.read_argv(mem, nr, args)
        except (OSError, ValueError) as exc:
            # Cannot tell what it runs: no (an argv past what the kernel takes: E2BIG, as
            # the kernel says it, "Argument list too long").
            confine.answer(listener, nid, False, E2BIG if getattr(exc, "errno", None) == E2BIG else EPERM)
            return
        finally:
            os.close(mem)
        key = (pid, st.st_dev, st.st_ino, tuple(argv))
        # The same exec refused, tried again by another name (/bin, /usr/bin): refused again
        # (its line on stderr said once). Kept or judged, every exec is recorded below.
        kept = self._refused.get(key)
        self.found = {}
        judged = kept or self._judged(pid, path, argv, st)
        verdict, rule = judged
        job = self.sup.job_of(pid)
        # None: no call's code ran it (what one left running): refused if it needs an
        # approval (no call to ask under), and recorded apart (``rules.Between``).
        kept_on = job if job is not None else self.sup.rules.between
        if verdict == "allow":
            confine.answer(listener, nid, True)
            # as the compiled judge records an exec it lets run (its first words: M in its config)
            words = kept_argv(argv[:MAX_EXEC_ARGV])
            record(
                kept_on, _named_file({"path": path, "argv": words, "verdict": verdict, "rule": ""}, target)
            )
            return
        matched = (
            execrules.judged_words(self._rules[rule], argv)
            if rule in self._rules and len(argv) > MAX_EXEC_ARGV
            else ()
        )
        done = {"path": path, "argv": shown_argv(argv, matched), "verdict": verdict, "rule": rule or ""}
        done = _named_file(done, target)
        if verdict == "approve":
            if not self.approver or job is None:
                done["verdict"] = "refuse"
                done["rule"] = (rule or "") + " (nobody to ask)"
                self._refuse(listener, nid, pid, done)
            else:
                self.requests += 1
                self.pending[self.requests] = (listener, nid, pid, job, done, key)
                job.hold()  # its deadline waits with it (the host's approver may be a human)
                # "own": whether the call's approval may answer for it (jobs.Job.own)
                ask = {"id": job.rid, "ev": "approve", "req": self.requests, **done, "own": job.own}
                runs = self.found.get(rule or "")
                if runs and runs != [execruns.program(argv[0]) if argv else "", *argv[1:]]:
                    # exec -a true rm -r x, a copy of rm named true, a #!/bin/rm -r script:
                    # the argv shows `true -r x`; the human is asked about `rm -r x`
                    words = self._rules.get(rule or "", [])
                    ask["runs"] = shown_argv(runs, execrules.judged_words(words, runs))
                self.sup.send(ask)
        else:
            self._refuse(listener, nid, pid, done, tell=kept is None)
            self._remember(key, judged)
        record(kept_on, done)

    def _judged(
        self, pid: int, path: str, argv: "List[str]", st: "os.stat_result"
    ) -> "Tuple[str, Optional[str]]":
        """The verdict on an exec of ``path`` (``st``: its file, looked at before it is read),
        kept for the same program, file and argv again (a loop, a build) while the file is
        as it was judged: its stamp, ctime included (a file rewritten in place at its size,
        its mtime set back with utime, was let run as what it became)."""
        seen: "Optional[Tuple[Any, ...]]" = (path, *_stamp(st), tuple(argv))
        if path.startswith("/proc/"):  # /proc/self/... is another file for each caller
            seen = None
        judged = self._verdicts.get(seen) if seen is not None else None
        if judged is not None:
            return judged
        self.carrying = False
        judged = self.judge(pid, path, argv, st)
        # An approval is asked each time; what a loader runs is another file, which can
        # change while this one and its argv stay as they are.
        if seen is not None and judged[0] != "approve" and not self.carrying and _settled(st):
            if len(self._verdicts) > 1024:
                self._verdicts.clear()
            self._verdicts[seen] = judged
        return judged

    def on_verdict(self, request: int, allow: bool, why: str = "") -> None:
        """The host's answer to an approval it was asked for; ``why``, the host's reason for a
        no that was no plain no (an approver's odd answer, its error), shown with the rule."""
        parked = self.pending.pop(request, None)
        if parked is None:
            return
        listener, nid, pid, job, done, key = parked
        job.release()
        if not allow and why:
            done["rule"] = f"{done['rule']} ({why[:300]})"
        if not allow:
            self._remember(key, ("refuse", done["rule"]))
        if not confine.still_waiting(listener, nid):
            return
        if allow:
            done["verdict"] = "approve"
            confine.answer(listener, nid, True)
        else:
            done["verdict"] = "refuse"
            self._refuse(listener, nid, pid, done)

    def expire(self, job: "Any") -> None:
        """A job ended: its approvals still waiting are refused (their callers are gone)."""
        for request, parked in list(self.pending.items()):
            if parked[3] is job:
                self.pending.pop(request)
                job.release()
                confine.answer(parked[0], parked[1], False, EPERM)

    def _remember(self, key: "Tuple[Any, ...]", refusal: "Tuple[str, Optional[str]]") -> None:
        if len(self._refused) > 256:
            self._refused.clear()
        self._refused[key] = refusal

    def _refuse(self, listener: int, nid: int, pid: int, done: "Dict[str, Any]", tell: bool = True) -> None:
        if tell:
            self._tell(pid, done)
        # EPERM, not EACCES: a PATH search (execvp) stops at it instead of asking again
        # for /bin/rm after /usr/bin/rm; shells report it and exit 126.
        confine.answer(listener, nid, False, EPERM)

    @staticmethod
    def _tell(pid: int, done: "Dict[str, Any]") -> None:
        why = "needs approval and was refused" if done["verdict"] == "refuse" else "denied by policy"
        line = f"stockade: {os.path.basename(done['path'])}: {why}: {done['rule']}\n"
        try:  # on the program's own stderr, where a person or a model will look
            fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.write(fd, line.encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError:
            pass

    # -- judging ----------------------------------------------------------------------------

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

    def _read(self, target: str, st: "os.stat_result", outside: bool) -> "Tuple[bytes, Set[str]]":
        """What the judge reads of the file: its head (a script's first line) and the names of
        the programs the rules name that it is a copy of, by content or, ``outside`` the
        image, by ELF build ID (a copy changed by a byte: padded, patched). ``OSError``
        where it cannot be read, or not as far as it goes."""
        head = _head(target)
        known = st.st_size in self._sizes or st.st_size in self._masked
        copies = self._copies_of(target, st) if known else set()
        if not copies and (self._sizes or self._masked_builds) and outside:
            copies = self._same_build(target, st)
        return head, copies

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
                runs = execruns.env_runs(_head(script)) if names else None
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

    def _real_name(self, target: str, st: "os.stat_result") -> "Optional[str]":
        """The name of the file ``target`` leads to (symlinks followed), cached by the file;
        None where ``target`` led to another file than ``st``'s by then (a link swapped
        between the two looks). Kept by ``st``'s file, the name of another one stayed: a link
        raced between ``ls`` and the ELF loader left ``ls`` judged as the loader for the
        sandbox's life (``ls /`` refused: "/" read as the program it loads)."""
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        name = self._names.get(key)
        if name is None:
            real = os.path.realpath(target)
            try:
                now = os.stat(real)
            except OSError:  # a name no file has (a descriptor's: "memfd:x (deleted)"): not kept
                return os.path.basename(real)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None
            if len(self._names) > 4096:
                self._names.clear()
            name = self._names[key] = os.path.basename(real)
        return name

    @staticmethod
    def _in_view(pid: int, path: str) -> str:
        """``path`` as the caller resolves it. /proc/self is the caller's, not ours, and so
        is any link that leads there (/dev/fd/N, /dev/stdin, one the code made): the links
        on the way are followed here, each one into /proc/self going to /proc/PID, and once
        in /proc/PID what is left is the kernel's to follow (its links are the caller's)."""
        return caller_path(pid, path)

    def _digest(self, path: str, st: "os.stat_result") -> str:
        """The SHA-256 of the file ``path`` (``st``: its stat, before it is read), kept by its
        stamp once settled. ``OSError`` where it cannot be read whole."""
        key = _stamp(st)
        digest = self._identity.get(key)
        if digest is None:
            import hashlib  # lazily: it loads OpenSSL, and few execs ever need it

            h = hashlib.sha256()
            fd = _open(path)
            try:
                size, done = os.fstat(fd).st_size, 0
                for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
                    h.update(chunk)
                    done += len(chunk)
            finally:
                os.close(fd)
            if done != size:
                raise OSError(EIO, "a short read")
            digest = h.hexdigest()
            if _settled(st):
                if len(self._identity) > 4096:
                    self._identity.clear()
                self._identity[key] = digest
        return digest

    def _program_digest(self, path: str) -> "Optional[str]":
        """The digest of a program a rule names; None where it is not there or cannot be read
        (a masked one: the host read it before, ``self._masked``)."""
        try:
            return self._digest(path, os.stat(path))
        except OSError:
            return None

    def _same_build(self, path: str, st: "os.stat_result") -> "Set[str]":
        """Names of the programs the rules name that ``path`` (a file the code can have
        written) was built as: the same ELF build ID, which a copy keeps when bytes are added
        or changed elsewhere. One changed there too is judged by its names only. ``OSError``
        where it cannot be read."""
        key = _stamp(st)
        if key in self._builds:
            found = self._builds[key]
        else:
            found = build_id(path)
            if _settled(st):
                if len(self._builds) > 4096:
                    self._builds.clear()
                self._builds[key] = found
        if found is None:
            return set()
        if self._program_builds is None:
            self._program_builds = {made: set(names) for made, names in self._masked_builds.items()}
            for paths in self._sizes.values():
                for original in paths:
                    try:
                        made = build_id(original)
                    except OSError:  # masked: the host read it before (self._masked_builds)
                        continue
                    if made is not None:
                        self._program_builds.setdefault(made, set()).add(os.path.basename(original))
        return self._program_builds.get(found, set())

    def _copies_of(self, path: str, st: "os.stat_result") -> "Set[str]":
        """Names of the programs the rules name whose content ``path`` holds. ``OSError``
        where it cannot be read whole."""
        found: "Set[str]" = set()
        mine: "Optional[str]" = None
        for original in self._sizes.get(st.st_size, ()):
            if original == path:
                continue
            theirs = self._program_digest(original)
            if theirs is None:
                continue
            if mine is None:
                mine = self._digest(path, st)
            if theirs == mine:
                found.add(os.path.basename(original))
        masked = self._masked.get(st.st_size)
        if masked:
            mine = mine or self._digest(path, st)
            found |= masked.get(mine, set())
        return found


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


# What the judge keeps of a file's content it keeps by the file's stamp, once the stamp is
# older than this: a change within the same tick of the clock timestamps are taken from (up
# to 10 ms), or the same second where a filesystem keeps seconds, may leave ctime as it was.
SETTLED_NS = 2_000_000_000


# The options an env shebang may give its interpreter (``#!/usr/bin/env -S node --x``) that
# are looked past for the script's path (ExecJudge._env_script).
MAX_ENV_WORDS = 8


def _file(st: "os.stat_result") -> "Tuple[int, int]":
    return st.st_dev, st.st_ino


def _named_file(done: "Dict[str, Any]", target: str) -> "Dict[str, Any]":
    """An exec's record, with the file that ran where its path led to another (a link the
    code made, /tmp/pip3 -> /usr/bin/python3.11): the trail names what ran, not only the
    name it was run by."""
    try:
        real = os.path.realpath(target)
    except (OSError, ValueError):
        return done
    if real != done["path"] and not real.startswith("/proc/"):
        done["file"] = real
    return done


def _stamp(st: "os.stat_result") -> "Tuple[int, int, int, int, int]":
    """A file, and its content as it was when ``st`` was taken: device, inode, size, mtime
    and ctime. mtime can be set back (utime); ctime cannot: every write, utime, chmod or
    rename moves it to the clock's time, which code cannot set."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _settled(st: "os.stat_result") -> bool:
    """Whether ``st``'s file last changed long enough ago that any later change moves its
    ctime past the one in ``st`` (SETTLED_NS)."""
    import time  # built in: no file to load

    return time.time_ns() - st.st_ctime_ns > SETTLED_NS


def _open(path: str) -> int:
    """``path`` opened for the judge to read, without waiting: a lease the code holds on it
    makes this fail (EWOULDBLOCK) where a blocking open would stop every exec for up to the
    lease's break time."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)


def _head(path: str) -> bytes:
    """The first bytes of the file ``path``: what the kernel reads to tell a script (it needs
    only the execute right for that, so a file the judge cannot read may still be one).
    ``OSError`` where it cannot be read, or not as far as the file goes."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, execruns.SCRIPT_HEAD)
    finally:
        os.close(fd)
    if len(head) < min(size, execruns.SCRIPT_HEAD):
        raise OSError(EIO, "a short read")
    return head


def exec_path(pid: int, path: str) -> str:
    """``path`` (absolute, no "." part) with its ".." parts resolved as the process ``pid``
    resolves them, its last name kept (a link's name is what the rules judge). Lexically,
    /tmp/l/../../usr/bin/true was /usr/bin/true, a program of the image, while the kernel
    ran true beside the folders /tmp/l leads to: a copy the code wrote there, of a program
    the rules name. ``OSError`` where the folder is only the caller's to walk (/proc/PID)."""
    if "/.." not in path:
        return path
    folder, _, name = path.rpartition("/")
    if name == "..":
        folder, name = path, ""
    real = caller_path(pid, folder or "/")
    if real.startswith("/proc/"):
        raise OSError(ELOOP, "a folder reached through the caller's /proc", path)
    return f"{real.rstrip('/')}/{name}" if name else real


def caller_path(pid: int, path: str) -> str:
    """``path`` resolved as the process ``pid`` resolves it (ExecJudge._in_view): a relative
    one from its working folder; ``OSError`` (ELOOP) past 40 links, as the kernel."""
    if not path.startswith("/"):
        path = f"/proc/{pid}/cwd/{path}"
    todo = [part for part in path.split("/") if part]
    done = ""
    hops = 0
    while todo:
        if done.startswith("/proc/") and done[6:].isdigit():  # the caller's: the kernel's to follow
            return "/".join([done, *todo])
        part = todo.pop(0)
        if part == ".":
            continue
        if part == "..":
            done = done.rsplit("/", 1)[0]
            continue
        here = f"{done}/{part}"
        if here in ("/proc/self", "/proc/thread-self"):
            done = f"/proc/{pid}"
            continue
        try:
            target = os.readlink(here)
        except OSError:  # no link (or nothing there: the stat after says so)
            done = here
            continue
        hops += 1
        if hops > 40:
            raise OSError(ELOOP, "too many levels of symbolic links", path)
        if target.startswith("/"):
            done = ""
        todo = [part for part in target.split("/") if part] + todo
    return done or "/"


ELOOP, EIO = 40, 5
