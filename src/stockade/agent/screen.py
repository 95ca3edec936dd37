"""What the loop takes of a model's tool calls before anything keeps them.

Any model (any adapter, or a hostile one) may send a call that no record can hold or no tool
can read: a name that is no tool's name (megabytes of it, control characters), arguments over
what one call may carry, nested past what a checkpoint can be read back with (pydantic's JSON
reader stops near 200 levels: the run could not resume), or holding text that is not Unicode
(a lone surrogate: valid JSON, no UTF-8 to store). Each becomes a malformed call, its
arguments dropped and its name cut to a quotable length, before the run's state, its trail or
its store sees it: the loop refuses it (``InvalidToolCall``: told to the model, audited,
counted against ``max_malformed``) and the run goes on. What was asked stays provable: the
refusal gives the size and SHA-256 of what was dropped.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from pydantic import JsonValue

from stockade.agent.state import args_json
from stockade.models.messages import ModelResponse, ToolCall

__all__ = ["MAX_CALL_ARGS_DEPTH", "MAX_TOOL_NAME_CHARS", "screened"]

MAX_TOOL_NAME_CHARS = 128  # a name is an identifier; a longer one is refused, quoted cut
MAX_CALL_ARGS_DEPTH = 64  # arrays and objects within each other; a tool's schema needs a few
_MAX_ID_CHARS = 128  # a longer call id (or one with control characters) is replaced
_SHOWN_CHARS = 64  # how much of a refused name is quoted
_MAX_MALFORMED_CHARS = 1024  # an adapter's reason for marking a call malformed


def screened(response: ModelResponse, *, step: int, max_args_bytes: int) -> ModelResponse:
    """``response`` with ids given to calls without a usable one, every call no record can hold
    made a malformed call without its arguments, and lone surrogates in its text replaced (the
    text is what the model said, not run: U+FFFD says where); the same object when nothing
    changed."""
    update: dict[str, object] = {}
    calls = tuple(_screened(c, step, k, max_args_bytes) for k, c in enumerate(response.tool_calls))
    if any(a is not b for a, b in zip(calls, response.tool_calls, strict=True)):
        update["tool_calls"] = calls
    for field in ("text", "model_name", "finish_reason"):
        said: str = getattr(response, field)
        if not _encodes(said):
            update[field] = _SURROGATE.sub("\ufffd", said)
    return response.model_copy(update=update) if update else response


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _screened(call: ToolCall, step: int, index: int, cap: int) -> ToolCall:
    update: dict[str, object] = {}
    if not _readable(call.id, _MAX_ID_CHARS):
        update["id"] = f"call_{step}_{index}"
    problem = None
    if not _readable(call.name, MAX_TOOL_NAME_CHARS):
        update["name"] = _shown(call.name)
        problem = (
            f"its tool name is {len(call.name):,} characters ({_digest(call.name)}), not a tool's name "
            f"(at most {MAX_TOOL_NAME_CHARS} printable characters); nothing was run"
        )
    problem = problem or _args_problem(call.args, cap)
    if problem is not None:
        update |= {"args": {}, "malformed": problem}
    elif call.malformed is not None and not _readable(call.malformed, _MAX_MALFORMED_CHARS, spaced=True):
        update["malformed"] = _shown(call.malformed, _MAX_MALFORMED_CHARS)
    return call.model_copy(update=update) if update else call


def _args_problem(args: Mapping[str, JsonValue], cap: int) -> str | None:
    """Why no record may keep ``args``, or None."""
    if _deeper_than(args, MAX_CALL_ARGS_DEPTH):
        return (
            f"its arguments are nested more than {MAX_CALL_ARGS_DEPTH} levels deep; nothing was run. "
            "Send flat arguments"
        )
    try:
        raw = args_json(args).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError, RecursionError):
        return "its arguments cannot be written as JSON; nothing was run"
    size, digest = len(raw), "sha256:" + hashlib.sha256(raw).hexdigest()
    try:
        raw.decode()
    except UnicodeDecodeError:
        return (
            f"its arguments ({size:,} bytes, {digest}) hold text that is not Unicode (a lone "
            "surrogate, such as \\udcfe); nothing was run. Send text as UTF-8"
        )
    if size > cap:
        return (
            f"its arguments are {size:,} bytes ({digest}), over the {cap:,} one call may carry; "
            "nothing was run. Send less at once: a large file in parts, or code that makes it"
        )
    return None


def _deeper_than(value: object, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` levels (no recursion:
    the value may be nested past the interpreter's limit)."""
    level: list[object] = [value]
    for _ in range(limit):
        level = [
            inner
            for v in level
            for inner in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
            if isinstance(inner, dict | list)
        ]
        if not level:
            return False
    return True


def _readable(text: str, limit: int, *, spaced: bool = False) -> bool:
    """Whether ``text`` is 1 to ``limit`` printable characters (no control character, no lone
    surrogate); ``spaced``: line breaks and tabs too."""
    if not 0 < len(text) <= limit:
        return False
    return (text.replace("\n", " ").replace("\t", " ") if spaced else text).isprintable()


def _shown(text: str, limit: int = _SHOWN_CHARS) -> str:
    """The first ``limit`` characters of ``text``, what is not printable escaped, to quote."""
    head = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return head + ("…" if len(text) > limit else "") if head else "(empty)"


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
