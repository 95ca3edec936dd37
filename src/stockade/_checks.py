"""Argument checks shared by the SDK's entry points: a wrong value fails at the call that
passed it, with ``InvalidArgument`` naming the argument and what to give instead, never later
as a bare ``TypeError``, a JSON error from deep inside, or a sandbox that silently misbehaves."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from stockade.exceptions import ConfigurationError, InvalidArgument

__all__ = [
    "check_acceptance",
    "check_choice",
    "check_data",
    "check_envs",
    "check_host_folder",
    "check_host_path",
    "check_id",
    "check_instance",
    "check_labels",
    "check_number",
    "check_strings",
    "check_text",
    "check_timeout",
]

E = TypeVar("E", bound=StrEnum)


def _shown(value: object) -> str:
    """The value as an error shows it: its repr, cut to 60 characters; its type's name when
    the repr raises (a caller's object whose ``__repr__`` fails still gets the typed error)."""
    try:
        # repr of a huge int is slow, or refused
        if isinstance(value, int) and not -(10**60) < value < 10**60:
            return f"an integer of about {value.bit_length() * math.log10(2):.0f} digits"
        text = repr(value)
    except Exception:  # any failure of the caller's code: its type still says what it was
        return f"a {type(value).__name__} (whose repr failed)"
    return text if len(text) <= 60 else text[:57] + "..."


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_choice(enum: type[E], value: object, *, argument: str) -> E:
    """``value`` as a member of ``enum`` (a member or its string value)."""
    if isinstance(value, enum):
        return value
    choices = ", ".join(repr(member.value) for member in enum)
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    raise InvalidArgument(
        f"{argument} is {_shown(value)}, which is not one of {choices}",
        argument=argument,
        fix=f"give one of {choices}",
    )


def check_number(
    value: object,
    *,
    argument: str,
    integer: bool,
    low: float,
    high: float,
    unit: str = "",
    low_inclusive: bool = True,
) -> None:
    """A finite int (or float, unless ``integer``) within ``low``..``high``; bools are refused."""
    kind = "a whole number" if integer else "a number"
    unit_text = f" {unit}" if unit else ""
    bounds = f"{'from' if low_inclusive else 'above'} {_num(low)} to {_num(high)}{unit_text}"
    fix = f"give {kind} {bounds}"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        raise InvalidArgument(
            f"{argument} must be {kind}, got {_shown(value)} ({type(value).__name__})",
            argument=argument,
            fix=fix,
        )
    if isinstance(value, float) and not math.isfinite(value):  # an int is finite (and may not fit a float)
        raise InvalidArgument(f"{argument} must be finite, got {value!r}", argument=argument, fix=fix)
    too_low = value < low if low_inclusive else value <= low
    if too_low or value > high:
        raise InvalidArgument(f"{argument} is out of range: {_shown(value)}", argument=argument, fix=fix)


# A week: longer is a mistake, not a plan, and the supervisor's poll timeout (milliseconds in
# 32 bits) ends at 24.8 days.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_COST_USD = 1e12  # the most a run's spend cap (RunLimits.max_cost_usd) may be


def check_timeout(value: object, *, argument: str = "timeout_s") -> float | None:
    """None (the default applies) or seconds > 0."""
    if value is None:
        return None
    check_number(
        value,
        argument=argument,
        integer=False,
        low=0,
        high=MAX_TIMEOUT_S,
        unit="seconds",
        low_inclusive=False,
    )
    assert isinstance(value, int | float)
    return float(value)


def check_envs(envs: Mapping[str, str] | None, *, argument: str = "envs") -> dict[str, str]:
    """Environment variables a process can actually receive: ``NAME=value`` splits at the first
    ``=``, so a name holding one (or a NUL anywhere) cannot be passed and is refused here."""
    if envs is None:
        return {}
    if not isinstance(envs, Mapping):
        raise InvalidArgument(
            f"{argument} must be a mapping of names to values, got {type(envs).__name__}",
            argument=argument,
            fix='give a dict such as {"NAME": "value"}',
        )
    checked: dict[str, str] = {}
    for name, value in envs.items():
        if not isinstance(name, str) or not name or "=" in name or "\x00" in name:
            raise InvalidArgument(
                f"{argument} has an invalid variable name {_shown(name)}",
                argument=argument,
                fix="a name is a non-empty string without '=' or NUL (the value goes on the right)",
            )
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidArgument(
                f"{argument}[{name!r}] must be a string without NUL, got {_shown(value)}",
                argument=argument,
                fix="give the value as text (str(value) for numbers)",
            )
        # and sendable: a lone surrogate has no UTF-8 to put in the environment
        checked[check_text(name, argument=argument)] = check_text(value, argument=f"{argument}[{name!r}]")
    return checked


def check_labels(labels: object, *, argument: str = "labels") -> dict[str, str]:
    """Names and values of text (``check_text``), the names not empty: what a sandbox is tagged with."""
    fix = 'give a dict of str to str, such as {"team": "infra"}'
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise InvalidArgument(
            f"{argument} must be a mapping of names to values, got {type(labels).__name__}",
            argument=argument,
            fix=fix,
        )
    checked: dict[str, str] = {}
    for name, value in labels.items():
        if not check_text(name, argument=argument, fix=fix):
            raise InvalidArgument(f"{argument} has an empty name", argument=argument, fix=fix)
        checked[name] = check_text(value, argument=f"{argument}[{name!r}]", fix=fix)
    return checked


MAX_ID_CHARS = 256


def check_id(value: object, *, argument: str, empty: bool = False) -> str:
    """An id the stores keep as it is (a run's, an actor's): text of 1 to 256 characters, no
    control character, and UTF-8 (no lone surrogate: SQLite refuses to store one, PostgreSQL a
    NUL, and an audit batch holding such an id failed for good, with every event after it).
    ``empty``: "" is accepted (an audit event of no run: the agent's own set-up)."""
    if not isinstance(value, str) or not (0 if empty else 1) <= len(value) <= MAX_ID_CHARS:
        raise InvalidArgument(
            f"{argument} must be text of 1 to {MAX_ID_CHARS} characters, got {_shown(value)}",
            argument=argument,
            fix="give an opaque id such as 'job-42' (leave it out for a random one where it may be)",
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise InvalidArgument(
            f"{argument} {_shown(value)} holds a control character or bytes that are no UTF-8",
            argument=argument,
            fix="give printable text (an opaque id such as 'job-42')",
        )
    return value


def check_text(value: object, *, argument: str, nul: bool = False, fix: str = "give text (a str)") -> str:
    """A str that can be sent as UTF-8: no lone surrogate (``"\\udc80"`` cannot be encoded),
    and no NUL unless ``nul`` (a path, an argument or a name ends at one)."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"{argument} must be a str, got {_shown(value)} ({type(value).__name__})",
            argument=argument,
            fix=fix,
        )
    if not nul and "\x00" in value:
        raise InvalidArgument(f"{argument} {_shown(value)} holds a NUL character", argument=argument, fix=fix)
    try:
        value.encode()
    except UnicodeEncodeError as err:
        raise InvalidArgument(
            f"{argument} holds {value[err.start : err.end]!r}, which is no UTF-8 (a lone surrogate)",
            argument=argument,
            fix="give text that encodes as UTF-8, or bytes where bytes are taken",
        ) from None
    return value


def check_acceptance(value: object, *, argument: str = "check") -> str:
    """An acceptance check: a shell line that is text (``check_text``: no NUL, UTF-8) and not
    blank. One rule wherever a check is given (the SDK, the API, the remote client), so a check
    that cannot run is refused when given, never found out when the run ends."""
    fix = 'give the command that decides whether the task is done, e.g. "python3 -m pytest -q"'
    line = check_text(value, argument=argument, fix=fix)
    if not line.strip():
        raise InvalidArgument(f"{argument} is {_shown(value)}, a blank line", argument=argument, fix=fix)
    return line


def check_data(value: object, *, argument: str) -> bytes:
    """Content given as text (sent as UTF-8) or bytes; anything else is refused, not ``str()``-ed."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return check_text(value, argument=argument, nul=True).encode()
    raise InvalidArgument(
        f"{argument} must be str or bytes, got {_shown(value)} ({type(value).__name__})",
        argument=argument,
        fix="give text or bytes (str(value) for a number, bytes(value) for a bytearray)",
    )


def check_strings(value: object, *, argument: str, empty: bool = True) -> tuple[str, ...]:
    """A list or tuple of texts (``check_text``); a lone str is refused (it is no list of
    one), as are a set or a mapping, whose order or meaning would be guessed."""
    fix = 'give a list of str, e.g. ["a", "b"]'
    if not isinstance(value, list | tuple):
        raise InvalidArgument(
            f"{argument} must be a list of str, got {_shown(value)} ({type(value).__name__})",
            argument=argument,
            fix=fix,
        )
    if not empty and not value:
        raise InvalidArgument(f"{argument} is empty", argument=argument, fix=fix)
    return tuple(check_text(item, argument=argument, fix=fix) for item in value)


def check_host_path(value: object, *, argument: str) -> Path:
    """A path on this host: a str or ``os.PathLike`` of str, without NUL (the kernel's end of a
    path). Bytes are refused: a host path is given as text (``os.fsdecode`` makes one)."""
    raw = os.fspath(value) if isinstance(value, os.PathLike) else value
    fix = "give a str or pathlib.Path of a folder on this host"
    if not isinstance(raw, str):
        raise InvalidArgument(
            f"{argument} must be a host path (str or Path), got {_shown(value)} ({type(value).__name__})",
            argument=argument,
            fix=fix,
        )
    if not raw or "\x00" in raw:
        raise InvalidArgument(f"{argument} {_shown(raw)} is no path", argument=argument, fix=fix)
    return Path(raw)


def check_host_folder(value: object, *, argument: str) -> Path:
    """``check_host_path`` of a folder that is there (``ConfigurationError`` when it is none).
    A name longer than the file system takes (ENAMETOOLONG: a part past 255 bytes, the whole
    past 4 KiB) is ``InvalidArgument`` naming the path, not the OSError of its first stat."""
    path = check_host_path(value, argument=argument)
    try:
        folder = path.is_dir()
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        text = str(path)  # its start and its end: where it is, and the name that went too far
        shown = repr(text if len(text) <= 120 else f"{text[:50]}...{text[-50:]}")
        raise InvalidArgument(
            f"{argument} {shown} is a path longer than the file system takes "
            "(a name in it past 255 bytes, or the whole past 4096)",
            argument=argument,
            fix="give a folder with a shorter path",
        ) from None
    if not folder:
        raise ConfigurationError(f"{argument} {str(path)!r} is not a directory")
    return path


T = TypeVar("T")


def check_instance(value: object, kind: type[T], *, argument: str, fix: str) -> T:
    """``value`` when it is a ``kind``; a dict or a str where a settings object is wanted is refused."""
    if not isinstance(value, kind):
        raise InvalidArgument(
            f"{argument} must be a {kind.__name__}, got {_shown(value)} ({type(value).__name__})",
            argument=argument,
            fix=fix,
        )
    return value
