"""Bounded observations: the model sees the head and the tail, the workspace keeps the rest.

A long tool output would crowd the model's context. ``bound`` keeps the first and last parts
and replaces the middle with a marker saying how much was cut and where the full text was
saved inside the workspace (``.stockade/outputs/``), so the model can page through it with
``read_file(path, offset, limit)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stockade._cuts import cut_marker
from stockade.exceptions import StockadeError
from stockade.tools.base import ToolContext

__all__ = ["OUTPUT_DIR", "Bounded", "bound", "clip"]

OUTPUT_DIR = ".stockade/outputs"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, kw_only=True)
class Bounded:
    text: str
    cut_chars: int = 0
    saved_to: str | None = None


def bound(ctx: ToolContext, text: str) -> Bounded:
    """Return ``text`` unchanged when short enough, else head + marker + tail."""
    limit = ctx.max_observation_chars
    if len(text) <= limit:
        return Bounded(text=text)
    path = f"{OUTPUT_DIR}/{ctx.step}-{_UNSAFE.sub('_', ctx.call_id)}.txt"
    try:
        ctx.records.files.write(path, text)  # the run's record, not the model's write
        lines = text.count("\n") + 1
        where = f"the full output ({lines} lines) is saved at {path}: page through it with read_file"
        saved: str | None = path
    except StockadeError as err:  # a full workspace must not turn into a failed step
        where = f"the full output could not be saved ({err})"
        saved = None
    head_len = limit * 2 // 3
    tail_len = limit - head_len
    head, tail = text[:head_len], text[-tail_len:]
    cut = len(text) - len(head) - len(tail)
    marker = cut_marker(cut, f"from the middle; {where}")
    return Bounded(text=head + marker + tail, cut_chars=cut, saved_to=saved)


def clip(text: str, limit: int) -> Bounded:
    """``text`` cut to about ``limit`` characters (head + marker + tail), the rest kept nowhere:
    for what the loop says itself (a refusal, a denial, why a run ended), which quotes what the
    model sent (a path, a key) and is no output to page through."""
    if len(text) <= limit:
        return Bounded(text=text)
    head, tail = text[: limit * 2 // 3], text[len(text) - (limit - limit * 2 // 3) :]
    cut = len(text) - len(head) - len(tail)
    return Bounded(text=f"{head}{cut_marker(cut)}{tail}", cut_chars=cut)
