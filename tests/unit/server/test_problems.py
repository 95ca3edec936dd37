"""The error tree as RFC 9457 problems (``stockade.server.problems``) and back into the SDK's
own errors by the client (``stockade.client._http.error_from``): every class has a status
that says who must act, the body names the field and the fix, and nothing else leaks."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from stockade import exceptions as exc
from stockade.client._http import error_from
from stockade.server import problems
from stockade.server.schemas import CommandRequest, RunSubmit, SandboxCreate

ERRORS = [
    cls
    for name in exc.__all__
    if isinstance(cls := getattr(exc, name), type) and issubclass(cls, exc.StockadeError)
]


def example(cls: type[exc.StockadeError]) -> exc.StockadeError:
    """An instance of ``cls`` with each of its keyword attributes set to something telling."""
    values: dict[str, Any] = {
        "argument": "limits.memory_mb", "fix": "give 64 or more", "setting": "memory",
        "problems": ("a:1: x",), "path": "src/a.py", "rule": "commands.deny", "action": "run rm",
        "quota": "cpus", "limit": 4.0,
        "used": 3.5, "cause": "out_of_memory", "kind": "sandbox", "id": "sbx_1", "provider": "openai",
        "status_code": 429, "key": "tenant:acme", "name": "docker", "tool": "run_code", "hunk": 2,
        "timeout_s": 3.0, "stdout": "secret output", "stderr": "", "retry_after": 2.2,
    }  # fmt: skip
    accepted = inspect.signature(cls.__init__).parameters
    return cls("it went wrong", **{k: v for k, v in values.items() if k in accepted})


def test_the_table_is_most_specific_first_so_that_every_row_can_be_reached() -> None:
    classes = [cls for cls, _ in problems._KINDS]
    for i, earlier in enumerate(classes):
        for later in classes[i + 1 :]:
            assert not issubclass(later, earlier), f"{later.__name__} is hidden behind {earlier.__name__}"


EXPECTED = {
    exc.AuthenticationError: 401, exc.ResourceNotFound: 404, exc.PolicyDenied: 403,
    exc.InvalidArgument: 422, exc.PathEscapeError: 422, exc.SandboxFileNotFound: 404,
    exc.FileTooLarge: 413, exc.QuotaExceeded: 429, exc.RateLimited: 429, exc.RunConflict: 409,
    exc.SandboxClosed: 410, exc.ServiceUnavailable: 503, exc.AuditStoreError: 503,
    exc.RunStoreError: 503, exc.RunLeased: 409, exc.SandboxStartError: 503, exc.SandboxCrashed: 502,
    exc.ModelRateLimited: 429, exc.ModelUnavailable: 502, exc.TierUnavailable: 422,
    exc.WorkspaceFull: 507, exc.SnapshotStoreFull: 507, exc.StockadeError: 500,
}  # fmt: skip


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_is_a_problem_with_a_status_that_says_who_acts(cls: type[exc.StockadeError]) -> None:
    error = example(cls)
    problem = problems.from_error(error, "/v1/sandboxes/sbx_1")
    body = json.loads(problem.content())
    assert body["status"] == problem.status and body["type"] == f"/problems/{problems.slug(cls.__name__)}"
    assert body["error"] == cls.__name__ and body["detail"] == str(error) and body["title"]
    assert body["retryable"] is error.retryable and body["instance"] == "/v1/sandboxes/sbx_1"
    if cls in EXPECTED:
        assert problem.status == EXPECTED[cls], cls
    if error.retryable:
        # for the caller's timing, the server's, or a provider's behind it: never "internal"
        assert problem.status in (409, 429, 502, 503), problem.status
    elif problem.status >= 500:  # not to be retried: broken for good, or a base class nobody raises
        assert cls in (exc.StockadeError, exc.AuditError, exc.SandboxError, exc.ServiceError,
                       exc.RunStoreCorrupt, exc.AuditIntegrityError, exc.SandboxCrashed, exc.ProtocolError,
                       exc.ModelError, exc.ModelAuthError, exc.ModelRequestRejected, exc.ModelResponseInvalid,
                       exc.WorkspaceFull, exc.SnapshotStoreFull,
                       exc.ImageNotFound, exc.SnapshotError), cls  # fmt: skip
    assert "secret output" not in problem.content().decode()  # a crash's output stays on the server
    described = problems.describe(problems.slug(cls.__name__))
    if described is not None:
        assert described["error"] in {c.__name__ for c, _ in problems._KINDS}


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_the_client_raises_the_same_error_again(cls: type[exc.StockadeError]) -> None:
    error = example(cls)
    problem = problems.from_error(error)
    again = error_from(json.loads(problem.content()), problem.status)
    assert type(again) is cls and str(again) == str(error) and again.retryable is error.retryable
    for attribute in ("path", "rule", "action", "quota", "limit", "used", "kind", "id", "provider", "key"):
        if attribute in error.__dict__ and error.__dict__[attribute] not in ("", ()):
            assert getattr(again, attribute) == error.__dict__[attribute], attribute
    if isinstance(error, exc.InvalidArgument):
        assert again.argument == "limits.memory_mb" and again.fix == "give 64 or more"  # type: ignore[attr-defined]


def test_retry_after_is_a_header_in_whole_seconds_and_401_names_the_scheme() -> None:
    problem = problems.from_error(exc.RateLimited("slow down", key="tenant:acme", retry_after=0.2))
    assert problem.status == 429 and problem.headers["Retry-After"] == "1"
    assert json.loads(problem.content())["retry_after"] == 0.2
    assert problems.from_error(exc.CircuitOpen("open", retry_after=7.6)).headers["Retry-After"] == "8"
    assert "Retry-After" not in problems.from_error(exc.PolicyDenied("no")).headers
    assert (
        problems.from_error(exc.AuthenticationError("who?")).headers["WWW-Authenticate"].startswith("Bearer")
    )


def test_an_unknown_error_name_from_a_server_falls_back_by_status() -> None:
    assert type(error_from({"error": "os", "detail": "x"}, 401)) is exc.AuthenticationError
    assert type(error_from({"error": "NotOurs"}, 404)) is exc.ResourceNotFound
    assert type(error_from({}, 502)) is exc.ServiceUnavailable
    assert type(error_from({"error": "__class__"}, 400)) is exc.ServiceError
    assert str(error_from({}, 418)) == "HTTP 418"


def validation_errors(model: type[BaseModel], data: object) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as failed:
        model.model_validate_json(data) if isinstance(data, str) else model.model_validate(data)
    return [dict(e) for e in failed.value.errors()]


def test_a_body_that_is_not_json_is_400_malformed() -> None:
    problem = problems.from_validation(validation_errors(SandboxCreate, '{"tier": '), "/v1/sandboxes")
    body = json.loads(problem.content())
    assert problem.status == 400 and body["type"] == "/problems/malformed-json" and body["field"] == "body"
    assert body["fix"] == "send a valid JSON document"


@pytest.mark.parametrize(
    ("model", "data", "field", "fix"),
    [
        (SandboxCreate, {"tier": "process", "colour": "red"}, "colour", "remove this field"),
        (SandboxCreate, {"limits": {"memory": 5}}, "limits.memory", "remove this field"),
        (SandboxCreate, {"idle_timeout_s": 0}, "idle_timeout_s", "give a value > 0"),
        (SandboxCreate, {"prefer": "fastest"}, "prefer", "give 'cheapest' or 'strongest'"),
        (CommandRequest, {}, "cmd", "give this field"),
        (RunSubmit, {"task": ""}, "task", "see the schema"),
        (RunSubmit, {"task": "x", "limits": {"max_steps": 0}}, "limits.max_steps", "give a value >= 1"),
        (RunSubmit, {"task": "x", "labels": {str(i): "v" for i in range(33)}}, "labels", "see the schema"),
    ],
)
def test_a_field_at_fault_is_named_with_its_fix(
    model: type[BaseModel], data: dict[str, Any], field: str, fix: str
) -> None:
    problem = problems.from_validation(validation_errors(model, data))
    body = json.loads(problem.content())
    assert problem.status == 422 and body["type"] == "/problems/invalid-request"
    assert body["field"] == field and body["fix"].startswith(fix), body
    assert body["error"] == "InvalidArgument" and body["errors"][0]["field"] == field
    again = error_from(body, problem.status)
    assert isinstance(again, exc.InvalidArgument) and again.argument == field


def test_several_faults_are_each_listed() -> None:
    body = json.loads(problems.from_validation(validation_errors(SandboxCreate, {"a": 1, "b": 2})).content())
    assert [e["field"] for e in body["errors"]] == ["a", "b"] and body["detail"].endswith("(and 1 more)")


def test_limits_out_of_range_name_the_limit() -> None:
    from stockade.server.schemas import LimitsIn

    with pytest.raises(exc.InvalidArgument) as wrong:
        LimitsIn(memory_mb=1).build()
    assert wrong.value.argument == "Limits.memory_mb"
    assert problems.from_error(wrong.value).status == 422


def test_files_that_could_take_the_memory_are_a_422_with_the_memory_that_holds_them() -> None:
    # A service's caller is told the least memory_mb, as a library caller is (not with 65,536:
    # an older client's default, taken as today's).
    from stockade.server.schemas import LimitsIn

    with pytest.raises(exc.InvalidArgument) as wrong:
        LimitsIn(memory_mb=128, inodes=60_000).build()
    problem = problems.from_error(wrong.value)
    assert problem.status == 422 and wrong.value.argument == "Limits.inodes"
    assert "raise memory_mb to at least 873, or lower inodes" in problem.content().decode()


def test_a_problem_type_is_described_and_an_unknown_one_is_not() -> None:
    described = problems.describe("quota-exceeded")
    assert described is not None and described["status"] == 429 and "quota" in described["description"]
    assert problems.describe("no-such-thing") is None
    assert problems.slug("PathEscapeError") == "path-escape" and problems.slug("Error") == "error"


def test_an_answer_lists_the_first_errors_and_counts_the_rest() -> None:
    errors = [{"type": "string_type", "loc": ("body", "cmd", i), "msg": "Input should be a valid string"}
              for i in range(233_000)]  # fmt: skip
    problem = problems.from_validation(errors, "/v1/sandboxes/sbx_1/commands")
    body = json.loads(problem.content())
    assert [e["field"] for e in body["errors"]] == [f"cmd.{i}" for i in range(20)]
    assert body["detail"] == "cmd.0: Input should be a valid string (and 232,999 more)"
    assert len(problem.content()) < 10_000


@pytest.mark.parametrize("retry_after", [float("inf"), float("nan"), 1e300])
def test_a_wait_past_any_sense_is_told_as_the_longest_one(retry_after: float) -> None:
    """Found from outside: a limit of a window of inf said ``retry_after = inf``, round() raised,
    and a rate-limited request was answered 500, not 429."""
    problem = problems.from_error(exc.RateLimited("slow down", retry_after=retry_after))
    assert problem.status == 429
    assert problem.headers["Retry-After"] == str(round(problems.MAX_RETRY_AFTER_S))
    json.dumps(problem.body, allow_nan=False)  # the body is JSON, which has no inf or nan
