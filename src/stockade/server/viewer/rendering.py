"""How the viewer's pages are rendered: the Jinja2 environment (autoescaped, every value shown
through ``visible``) and its filters (a time, a diff's lines and their classes). Apart from the
routes: what reaches a page, and how, is decided here alone.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from stockade._display import visible

__all__ = ["diff_class", "diff_lines", "templates"]


def templates() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("stockade.server.viewer", "templates"),
        autoescape=True,  # every template, whatever its name: nothing is rendered raw
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_shown,
    )
    env.filters["when"] = lambda ts: datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    env.filters["diff_class"] = diff_class
    env.filters["diff_lines"] = diff_lines
    return env


def _shown(value: object) -> object:
    """Each value a template renders, its untrusted text included: nothing that reorders what is
    drawn (bidi controls) or is not seen (zero-width characters) reaches the page raw."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return visible(value)
    return value


def diff_lines(diff: str) -> list[str]:
    """A diff's lines: ended by newlines alone, as git ends them. ``str.splitlines`` also ends a
    line at a form feed, a vertical tab, U+0085, U+2028..., which a changed file's line may
    hold: the rest of that line was drawn as a line of its own, classed by its first
    character (a ``+`` or ``-`` there read as a line added or removed)."""
    lines = diff.split("\n")
    return lines[:-1] if lines and not lines[-1] else lines


def diff_class(line: str) -> str:
    if line.startswith(("+++", "---")):
        return "file"
    if line.startswith("@@"):
        return "hunk"
    return {"+": "add", "-": "del"}.get(line[:1], "ctx")
