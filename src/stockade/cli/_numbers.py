"""Numbers given on the command line, checked whole: click's ranges let ``nan`` through (it
compares false with every bound) and ``inf`` past a lower one, and those ended in a traceback
or in a server that started but could serve nothing."""

from __future__ import annotations

import math

from stockade import exceptions as exc

__all__ = ["checked"]


def checked(
    value: float, option: str, *, least: float = 0.0, zero: bool = False, most: float = math.inf
) -> float:
    """``value`` of ``option``: finite, above ``least`` (or equal to it, with ``zero``) and at
    most ``most``; ``InvalidArgument`` otherwise (the CLI's exit 2)."""
    fits = math.isfinite(value) and (value >= least if zero else value > least) and value <= most
    if not fits:
        bound = f">= {least:g}" if zero else f"> {least:g}"
        bound += f" and <= {most:g}" if math.isfinite(most) else ""
        raise exc.InvalidArgument(
            f"{option} is {value!r}", argument=option, fix=f"give a finite number {bound}"
        )
    return value
