"""Engine failures map once to stockade errors: transient ones are retryable, the rest say how to fix."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

docker = pytest.importorskip("docker")
requests = pytest.importorskip("requests")

from stockade import exceptions as exc  # noqa: E402
from stockade.sandbox import SandboxSpec  # noqa: E402
from stockade.sandbox.docker import DockerBackend, engine_error  # noqa: E402


def api_error(status: int, explanation: str) -> Exception:
    response = requests.Response()
    response.status_code = status
    error: Exception = docker.errors.APIError("engine said no", response=response, explanation=explanation)
    return error


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (requests.exceptions.ConnectionError("connection refused"), exc.BackendUnavailable),
        (FileNotFoundError("/var/run/docker.sock"), exc.BackendUnavailable),
        (api_error(500, "OCI runtime create failed"), exc.SandboxStartError),
        (api_error(409, "Conflict. The container name is already in use"), exc.SandboxStartError),
    ],
)
def test_transient_engine_failures_are_retryable(
    failure: Exception, expected: type[exc.StockadeError]
) -> None:
    mapped = engine_error(failure)
    assert type(mapped) is expected
    assert mapped.retryable


def test_a_missing_image_says_how_to_build_it() -> None:
    mapped = engine_error(docker.errors.ImageNotFound("No such image: stockade-sandbox:latest"), image="x:1")
    assert isinstance(mapped, exc.ImageNotFound)
    assert not mapped.retryable
    assert "stockade image build --offline" in str(mapped)


def test_an_invalid_limit_is_a_configuration_error() -> None:
    mapped = engine_error(api_error(400, "Minimum memory limit allowed is 6MB"))
    assert isinstance(mapped, exc.ConfigurationError)
    assert not mapped.retryable


def test_a_missing_runtime_names_the_setup_script() -> None:
    mapped = engine_error(api_error(400, "Unknown runtime specified runsc"), runtime="runsc")
    assert isinstance(mapped, exc.ConfigurationError) and "setup-docker.sh" in str(mapped)


def test_an_image_without_its_program_is_not_told_to_register_a_runtime() -> None:
    # The OCI runtime reports an exec that failed ("OCI runtime create failed"): the runtime
    # is there, the image lacks the program.
    refused = 'OCI runtime create failed: exec: "python3": executable file not found in $PATH'
    mapped = engine_error(api_error(400, refused))
    assert isinstance(mapped, exc.ConfigurationError) and "python3" in str(mapped)
    assert "setup-docker.sh" not in str(mapped) and "no runtime" not in str(mapped)


@pytest.mark.parametrize("where", ["base_url", "DOCKER_HOST"])
def test_no_engine_is_retryable_and_leaves_no_socket_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A host with no engine running (no socket, or one nobody listens on) is told so, and
    each attempt closes its socket: docker-py left it to the collector, a ResourceWarning
    per attempt (so on a machine without Docker every test of the suite failed)."""
    url = f"unix://{tmp_path / 'docker.sock'}"
    if where == "DOCKER_HOST":
        monkeypatch.setenv("DOCKER_HOST", url)
    backend = DockerBackend(base_url=url if where == "base_url" else None)
    for _ in range(3):
        report = backend.probe()
        assert not report.available and "the Docker engine is unreachable" in report.detail
        with pytest.raises(exc.BackendUnavailable) as caught:
            backend.start(SandboxSpec())
        assert caught.value.retryable
    gc.collect()  # the suite turns warnings into errors: a socket left open fails the test
