"""What the exec judge inside reports of the execs it judged (``exec_records``): untrusted
words from the sandbox, bounded and made text before they become ``ExecRecord`` values.

Apart from the plan (``_rules``): it reads replies, once the sandbox runs.
"""

from __future__ import annotations

from typing import Any

from stockade.sandbox.supervisor.protocol import MAX_EXEC_ARGV, MAX_EXEC_RECORDS, MAX_EXEC_WORD
from stockade.types import ExecRecord

# A word of a record: MAX_EXEC_WORD characters, and the mark of a word cut (its length and SHA-256).
_WORD = MAX_EXEC_WORD + 160


def exec_records(header: dict[str, Any], *, between: bool = False) -> tuple[ExecRecord, ...]:
    """The execs a final frame reports (untrusted: bounded, and every field made text);
    ``between``: those a ``between`` frame or a ``TakeExecs`` answer hands over (judged while
    no call ran)."""
    raw = header.get("execs")
    if not isinstance(raw, list):
        return ()
    out = []
    for item in raw[:MAX_EXEC_RECORDS]:
        if not isinstance(item, dict):
            continue
        out.append(
            ExecRecord(
                path=str(item.get("path", ""))[:4096],
                argv=_words_of(item.get("argv")),
                verdict=str(item.get("verdict", ""))[:16],
                rule=str(item.get("rule", ""))[:512],
                between=between,
                runs=_words_of(item.get("runs")),
                file=str(item.get("file", ""))[:4096],
            )
        )
    return tuple(out)


def _words_of(raw: Any) -> tuple[str, ...]:
    return tuple(str(a)[:_WORD] for a in raw[:MAX_EXEC_ARGV]) if isinstance(raw, list) else ()
