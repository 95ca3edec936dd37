"""Every request the API takes is bounded by what the layer below would accept anyway, and
refused with a 422 before any work: a command the kernel could never run (an argument over
128 KiB, arguments and environment over 2 MiB, more arguments than fit in that), environments,
labels and names past any use. 4 million arguments are one error, not 4 million: a list's
length, or its first wrong item; nor are 233,000 wrong items 233,000 errors."""

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
        # its length, or the first item that is not a string (a list stops there)
        assert (errors[0]["loc"], errors[0]["type"]) in (
            (("cmd", "argv"), "too_long"), (("cmd", "argv", 0), "string_type")
        )  # fmt: skip


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


@pytest.mark.parametrize("check", ["true\x00base64 /etc/hostname", "", "   "])
def test_an_acceptance_check_that_cannot_run_is_refused_before_it_takes_a_queue_place(check: str) -> None:
    """The SDK's rule for a check (no NUL, not blank): the service queued these, and each took a
    worker's slot to fail when its run ended."""
    (error,) = refused(RunSubmit, {"task": "t", "check": check})
    assert error["loc"] == ("check",)
    assert "NUL" in error["msg"] or "blank" in error["msg"]
    assert RunSubmit.model_validate({"task": "t", "check": "pytest -q"}).check == "pytest -q"


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


@pytest.mark.parametrize(
    ("model", "data", "field"),
    [
        (CommandRequest, {"cmd": [1] * 233_000}, ("cmd", "argv", 0)),  # 466 KB of JSON
        (CommandRequest, {"cmd": ["a", 1, *[None] * 10_000]}, ("cmd", "argv", 1)),
        (SandboxCreate, {"envs": {f"V{i}": 1 for i in range(170_000)}}, ("envs",)),
        (NetworkIn, {"allow_hosts": [1] * 1000}, ("allow_hosts", 0)),
        (RunSubmit, {"task": "x", "scripted": [{1}] * 10_000}, ("scripted", 0)),
    ],
    ids=["argv", "argv-after-a-string", "envs", "hosts", "scripted"],
)
def test_a_list_or_map_of_wrong_items_is_one_error_not_one_an_item(
    model: type[Any], data: dict[str, Any], field: tuple[object, ...]
) -> None:
    """pydantic made one error per item (233,000 for that argv: ~3 s of the event loop and a 27
    MB answer, while other tenants waited); the first wrong item is the request's one error."""
    errors = refused(model, data)
    assert len(errors) == 1, errors[:3]
    assert errors[0]["loc"] == field


def test_many_unknown_fields_are_one_error_and_a_few_are_each_named() -> None:
    many = refused(SandboxCreate, {f"field{i}": 1 for i in range(100_000)})
    assert len(many) == 1 and many[0]["type"] == "extra_forbidden"
    assert many[0]["msg"].startswith("100,000 unknown fields, the first: field0, field1")
    few = refused(SandboxCreate, {"tier": "process", **{f"field{i}": 1 for i in range(3)}})
    assert [e["loc"] for e in few] == [("field0",), ("field1",), ("field2",)]
