"""Read a policy file (TOML or YAML) and say, for every mistake, where it is.

policy.toml:7: commands.deny.1: Input should be a valid string
policy.yaml:12: network: allow_hosts is set but the network is off: set enabled = true
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stockade._checks import check_host_path
from stockade._config_file import read_config_bytes
from stockade.exceptions import ConfigurationError, InvalidArgument, PolicyFileError
from stockade.policy.schema import Policy

__all__ = ["load_policy", "parse_policy", "policy_digest"]

Loc = tuple[str | int, ...]
_TABLE = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-\"'.]+)\s*=")


def _toml_lines(text: str) -> dict[Loc, int]:
    """Where each table and key starts (line numbers for errors; tomllib does not keep them)."""
    lines: dict[Loc, int] = {}
    table: Loc = ()
    counts: dict[Loc, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        header = _TABLE.match(line)
        if header:
            path: Loc = tuple(p.strip().strip("\"'") for p in header.group(2).split("."))
            if header.group(1) == "[[":
                index = counts.get(path, 0)
                counts[path] = index + 1
                path = (*path, index)
            table = path
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            parts = tuple(p.strip("\"'") for p in key.group(1).split("."))
            lines.setdefault((*table, *parts), number)
    return lines


def _yaml_lines(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    import yaml

    lines: dict[Loc, int] = {}

    def walk(node: yaml.Node, path: Loc) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*path, str(key.value))
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, (*path, index))

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, lines
        _count_nodes(root, source)
        walk(root, ())
        return loader.construct_document(root), lines
    finally:
        loader.dispose()


# The nodes a YAML policy may hold once its aliases are expanded. An alias is a reference: nine
# levels of anchors each used ten times (a "billion laughs") are a few lines of text that expand
# to 10^9 nodes, and took 3 GB before MemoryError. A real policy has a few hundred.
MAX_YAML_NODES = 100_000


def _count_nodes(root: Any, source: str) -> None:
    """``PolicyFileError`` when ``root`` expands to more than ``MAX_YAML_NODES`` nodes, counted
    as read (a node an alias reaches counts each time), with a stop at the budget."""
    import yaml

    count = 0
    todo = [root]
    while todo:
        node = todo.pop()
        count += 1
        if count > MAX_YAML_NODES:
            problem = (
                f"{source}: the YAML expands to more than {MAX_YAML_NODES} values (its aliases "
                "repeat what they refer to): write the policy out"
            )
            raise PolicyFileError(problem, problems=(problem,))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                todo.extend((key, value))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(node.value)


def _line_of(loc: Loc, lines: Mapping[Loc, int]) -> int | None:
    for end in range(len(loc), -1, -1):
        found = lines.get(loc[:end])
        if found is not None:
            return found
    return None


def _read(text: str, format: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """The data of a policy's text and the line of each key; a text that is no TOML (YAML)
    is a ``PolicyFileError`` naming where."""
    try:
        if format == "toml":
            return tomllib.loads(text), _toml_lines(text)
        elif format in ("yaml", "yml"):
            try:
                return _yaml_lines(text, source)
            except ModuleNotFoundError:
                raise ConfigurationError('YAML policies need PyYAML: pip install "stockade[yaml]"') from None
        else:
            raise ConfigurationError(f"unknown policy format {format!r}; use toml or yaml")
    except RecursionError:  # both parsers recurse once a nesting level: too deep is a mistake
        problem = f"{source}: the policy nests lists or tables too deeply to read"
        raise PolicyFileError(problem, problems=(problem,)) from None
    except tomllib.TOMLDecodeError as err:
        raise PolicyFileError(f"{source}: {err}", problems=(f"{source}: {err}",)) from None
    except ValueError as err:  # yaml.YAMLError is not a ValueError; handled below
        raise PolicyFileError(f"{source}: {err}", problems=(f"{source}: {err}",)) from None
    except Exception as err:
        if type(err).__module__.startswith("yaml"):
            mark = getattr(err, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark is not None else source
            problem = f"{where}: {getattr(err, 'problem', None) or err}"
            raise PolicyFileError(problem, problems=(problem,)) from None
        raise


def parse_policy(text: str, *, format: str = "toml", source: str = "<policy>") -> Policy:
    """Validate a policy given as text; ``PolicyFileError`` lists every problem with its line."""
    if not isinstance(text, str):
        raise InvalidArgument(
            f"a policy is text, got {type(text).__name__}",
            argument="text",
            fix="give the file's text (data.decode() for bytes), or use load_policy(path)",
        )
    data, lines = _read(text, format, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problem = f"{source}: a policy is a table of sections, got {type(data).__name__}"
        raise PolicyFileError(problem, problems=(problem,))
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc: Loc = tuple(e["loc"])
            line = _line_of(loc, lines)
            where = f"{source}:{line}" if line is not None else source
            field = ".".join(str(p) for p in loc) or "(top level)"
            message = str(e["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {field}: {message}")
        summary = f"{len(problems)} problem(s) in the policy:\n" + "\n".join(f"  {p}" for p in problems)
        raise PolicyFileError(summary, problems=tuple(problems)) from None


def load_policy(path: str | Path) -> Policy:
    """Read ``.toml``, ``.yaml`` or ``.yml``."""
    file = check_host_path(path, argument="path")
    suffix = file.suffix.lower().lstrip(".")
    fmt = "yaml" if suffix in ("yaml", "yml") else "toml"
    data = read_config_bytes(file, what="the policy file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        problem = f"{file.name}: byte {err.start} is not UTF-8 (a policy file is UTF-8 text)"
        raise PolicyFileError(problem, problems=(problem,)) from None
    return parse_policy(text, format=fmt, source=file.name)


def policy_digest(path: str | Path) -> str | None:
    """The SHA-256 of a policy file's bytes as they are now (``None``: it cannot be read): a run
    keeps it with its policy, so that a replay can say when the file changed since."""
    try:
        return "sha256:" + hashlib.sha256(read_config_bytes(path, what="the policy file")).hexdigest()
    except ConfigurationError:
        return None
