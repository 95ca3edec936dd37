"""Every request the API takes is bounded by what the layer below would accept anyway, and
refused with a 422 before any work: a command the kernel could never run (an argument over
128 KiB, arguments and environment over 2 MiB, more arguments than fit in that), environments,
labels and names past any use. A list's length is checked before its items: 4 million
arguments are one error, not 4 million."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from stockade.server.schemas import (
    MAX_ARG_CHARS,
    MAX_ARGS,
    MAX_ARGS_BYTES,
    CommandRequest,
    KillAllRequest,
    NetworkIn,
    RunSubmit,
    SandboxCreate,
)


def refused(model: type[Any], data: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return [dict(e) for e in caught.value.errors()]


def test_an_argv_longer_than_any_exec_takes_is_one_error_whatever_its_items() -> None:
    items: tuple[object, ...] = ("a", 5, None, [])
    for item in items:
        errors = refused(CommandRequest, {"cmd": [item] * 4_000_000})
        assert len(errors) == 1, errors[:3]
        assert errors[0]["loc"] == ("cmd", "argv") and errors[0]["type"] == "too_long"


def test_a_command_the_kernel_runs_is_taken() -> None:
    assert CommandRequest.model_validate({"cmd": "echo hi"}).cmd == "echo hi"
    longest = ["a" * MAX_ARG_CHARS] + ["b"] * 100
    assert CommandRequest.model_validate({"cmd": longest}).cmd == longest
    assert len(CommandRequest.model_validate({"cmd": ["x"] * 200_000}).cmd) == 200_000


def test_one_argument_over_128_kib_is_refused_as_a_line_or_in_an_argv() -> None:
    too_long = "a" * (MAX_ARG_CHARS + 1)
    assert refused(CommandRequest, {"cmd": too_long})[0]["loc"] == ("cmd", "line")
    assert refused(CommandRequest, {"cmd": ["ls", too_long]})[0]["loc"] == ("cmd", "argv", 1)
    # bytes, not characters: 70,000 two-byte characters are 140,000 bytes
    (error,) = refused(CommandRequest, {"cmd": ["é" * 70_000]})
    assert "140,000 bytes" in error["msg"]


def test_arguments_and_environment_over_2_mib_together_are_refused() -> None:
    half = ["a" * 100_000] * 11  # 1.1 MB of arguments
    assert CommandRequest.model_validate({"cmd": half}).cmd == half
    envs = {f"V{i}": "b" * 100_000 for i in range(11)}
    (error,) = refused(CommandRequest, {"cmd": half, "envs": envs})
    assert f"{MAX_ARGS_BYTES:,}" in error["msg"] and "stdin" in error["msg"]
    # each argument costs its pointer and NUL as well: as many one-byte ones as fit, no more
    (error,) = refused(CommandRequest, {"cmd": ["a"] * (MAX_ARGS - 1), "envs": {"A": "b" * 1000}})
    assert f"{MAX_ARGS_BYTES:,}" in error["msg"]


def test_an_environment_is_bounded_by_the_same_rules() -> None:
    assert refused(CommandRequest, {"cmd": "true", "envs": {"": "x"}})[0]["loc"] == ("envs", "", "[key]")
    assert refused(CommandRequest, {"cmd": "true", "envs": {"A": "a" * (MAX_ARG_CHARS + 1)}})
    many = {str(i): "" for i in range(MAX_ARGS + 1)}
    (error,) = refused(SandboxCreate, {"envs": many})
    assert error["loc"] == ("envs",) and error["type"] == "too_long"
    big = {f"V{i}": "b" * 100_000 for i in range(30)}  # 3 MB given to each of its commands
    assert "2,097,152" in refused(SandboxCreate, {"envs": big})[0]["msg"]


def test_labels_names_and_lists_of_a_request_are_bounded() -> None:
    assert refused(SandboxCreate, {"labels": {"k": "v" * 5000}})[0]["loc"] == ("labels", "k")
    assert refused(SandboxCreate, {"labels": {"k" * 300: "v"}})[0]["loc"] == ("labels", "k" * 300, "[key]")
    assert refused(SandboxCreate, {"labels": {str(i): "" for i in range(33)}})[0]["type"] == "too_long"
    assert refused(SandboxCreate, {"tier": "t" * 1000})[0]["loc"] == ("tier",)
    assert refused(NetworkIn, {"allow_hosts": ["a.example"] * 1001})[0]["type"] == "too_long"
    assert refused(CommandRequest, {"cmd": "ls", "cwd": "d" * 5000})[0]["loc"] == ("cwd",)
    assert refused(RunSubmit, {"task": "t", "check": "x" * (MAX_ARG_CHARS + 1)})[0]["loc"] == ("check",)
    assert refused(RunSubmit, {"task": "t", "model": "m" * 1000})[0]["loc"] == ("model",)
    assert refused(KillAllRequest, {"tenant": "t" * 1000})[0]["loc"] == ("tenant",)
