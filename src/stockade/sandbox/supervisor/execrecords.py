"""The records of the execs the rules judged, as a job's report keeps them.

Both judges record here: the Python judge (``execjudge``) each exec it answers, and the
supervisor each exec the compiled judge let run (``fastjudge``, taking in its records). The
report's bounds are the same for both (``protocol``'s), and what they keep of an argv too,
so they are apart from either judge. Standard library only.
"""

from __future__ import annotations

from protocol import (
    MAX_EXEC_RECORD_ARGV,
    MAX_EXEC_RECORDS,
    MAX_EXEC_REPORT,
    MAX_EXEC_WORD,
    dumps,
    text_size,
)

# Of a report's records (and of their bytes), the room the execs the rules let run may take:
# the rest is kept for those they stopped or asked about, so that a loop of 1,000 `true`
# cannot push an `rm -r` out of the report (the count of every exec goes with it: ``exec_count``).
ALLOWED_RECORDS = MAX_EXEC_RECORDS - 100
ALLOWED_REPORT = MAX_EXEC_REPORT - (128 << 10)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Dict, List


class Between:
    """The execs judged while no call of theirs ran: started by what an earlier call left
    running (a thread of the interpreter, a child), which no job leads. Kept as a job's are
    (``record``: the same bounds, the rest counted) until the host takes them: with the next
    call's report (``Rules.expire``) or by asking (``op_execs``, before a reset and at close).
    Dropped uncounted, they were judged and recorded nowhere (found from outside: a thread's
    ``cp -r`` after its call returned)."""

    def __init__(self) -> None:
        self.execs: "List[Dict[str, Any]]" = []
        self.exec_count = 0
        self.exec_json = self.exec_chars = 0  # of the records kept (fits)
        self.exec_width = 1

    def report(self) -> "Dict[str, Any]":
        return {"execs": self.execs, "exec_count": self.exec_count} if self.exec_count else {}


def record(job: "Any", done: "Dict[str, Any]") -> None:
    """One judged exec, onto the job whose code ran it: the first ones the rules let run, and
    every one they stopped or asked about (up to the report's bounds); the rest counted.
    ``done``'s argv is as ``kept_argv`` keeps it. ``job`` is ``Rules.between`` for an exec
    no call's code ran."""
    job.exec_count += 1
    allowed = done.get("verdict") == "allow"
    room = ALLOWED_RECORDS if allowed else MAX_EXEC_RECORDS
    if len(job.execs) < room and fits(job, done, ALLOWED_REPORT if allowed else MAX_EXEC_REPORT):
        job.execs.append(done)


def fits(job: "Any", done: "Dict[str, Any]", room: int) -> bool:
    """Whether the record ``done`` fits the job's report, its records' JSON and text (their
    characters at the widest width among them: ``protocol.text_size``) under ``room``
    bytes with it; if so, it is counted in."""
    raw = dumps(done).encode()
    chars, width = text_size(raw)
    size, chars, width = job.exec_json + len(raw) + 1, job.exec_chars + chars + 1, max(width, job.exec_width)
    if size > room or chars * width > room:
        return False
    job.exec_json, job.exec_chars, job.exec_width = size, chars, width
    return True


def kept_argv(argv: "List[str]") -> "List[str]":
    """What a record and an approval keep of ``argv`` (MAX_EXEC_ARGV words at most): each word
    up to MAX_EXEC_WORD characters, and MAX_EXEC_RECORD_ARGV over them all, shared out so
    that the longest words are cut first and alike (cut to the same length: a word of up to
    MAX_EXEC_RECORD_ARGV / MAX_EXEC_ARGV characters is always whole, where the words before
    it once took all the room and a `-r` after them was cut to nothing); a word cut is its
    head and a mark saying how much more and its SHA-256 (two words alike in their heads
    stay two requests for an approver)."""
    lengths = [len(word) for word in argv]
    if sum(lengths) <= MAX_EXEC_RECORD_ARGV and max(lengths, default=0) <= MAX_EXEC_WORD:
        return argv
    cap, room = MAX_EXEC_WORD, MAX_EXEC_RECORD_ARGV
    if sum(min(n, cap) for n in lengths) > room:
        ordered = sorted(min(n, cap) for n in lengths)
        for at, n in enumerate(ordered):  # the shortest whole, the rest cut to an equal share
            share = room // (len(ordered) - at)
            if n > share:
                cap = share
                break
            room -= n
    out = []
    for word in argv:
        if len(word) > cap:
            import hashlib

            digest = hashlib.sha256(word.encode("utf-8", "surrogateescape")).hexdigest()
            word = f"{word[:cap]}[... {len(word) - cap} more characters; the word is sha256 {digest}]"
        out.append(word)
    return out
