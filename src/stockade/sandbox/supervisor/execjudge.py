"""The exec judge in Python: each exec that reaches the supervisor, judged and answered.

The supervisor judges each exec here (``on_exec``) with the argv the kernel was given,
records it on the job whose code ran it, and answers: run, or fail with EPERM and a line on
the program's stderr. An exec that needs approval waits while the host asks (``approve``
frames); the host's answer comes back as a ``verdict`` request (``on_verdict``).

Here: the round trip of one notification (read, judge, answer, record) and what a record
and an approval show of a long argv (``shown_argv``). The verdict itself is the judge's base
class's (``execverdicts.ExecVerdicts``, over what the file is: ``execfiles``), and where
the exec's path leads is the caller's view of it (``execpaths``).

Loaded at the first exec that reaches Python (``rules.Rules.python_judge``): where the
compiled judge runs, most sandboxes never need it, and a start need not import it.
Standard library only.
"""

from __future__ import annotations

import os

import confine
import execfiles
import execrules
import execruns
from execpaths import exec_path
from execrecords import kept_argv, record
from execverdicts import ExecVerdicts
from protocol import MAX_EXEC_ARGV
from rules import E2BIG, ENOENT, EPERM

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


class ExecJudge(ExecVerdicts):
    """What the command rules say of an exec, by every name the program goes by (its base,
    ``ExecVerdicts``), and the round trip of one notification (read, judge, answer, record)."""

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
        super().__init__(commands, sizes, masked, listed)
        self.approver = approver
        # a rule as a record names it (as written, or as matched: `npm i` is `npm install`)
        # -> its words (what an argv cut must show: shown_argv)
        self._rules = {
            f"commands.{kind}: " + " ".join(form): words
            for kind, patterns in commands.items()
            for words in patterns
            for form in (words, execrules.pattern(words))
        }
        self.pending: "Dict[int, Tuple[int, int, int, Any, Dict[str, Any], Tuple[Any, ...]]]" = {}
        self.requests = 0
        # (pid, file, argv) -> the refusal: the same exec again by another name (a PATH
        # search's next folder) is refused as it was. Refusals only: an allow kept so let a
        # script that rewrote itself run as what it became, unjudged and unrecorded.
        self._refused: "Dict[Tuple[Any, ...], Tuple[str, Optional[str]]]" = {}
        # (path, the file's stamp, argv) -> the judge's verdict and rule
        self._verdicts: "Dict[Tuple[Any, ...], Tuple[str, Optional[str]]]" = {}

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
        # approval (no call to ask under), and recorded apart (``execrecords.Between``).
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
        seen: "Optional[Tuple[Any, ...]]" = (path, *execfiles.stamp(st), tuple(argv))
        if path.startswith("/proc/"):  # /proc/self/... is another file for each caller
            seen = None
        judged = self._verdicts.get(seen) if seen is not None else None
        if judged is not None:
            return judged
        self.carrying = False
        judged = self.judge(pid, path, argv, st)
        # An approval is asked each time; what a loader runs is another file, which can
        # change while this one and its argv stay as they are.
        if seen is not None and judged[0] != "approve" and not self.carrying and execfiles.settled(st):
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
