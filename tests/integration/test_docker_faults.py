"""The Docker tier under faults: a container killed from outside, the engine going away,
and many create/close cycles that must leave nothing behind."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import secrets
import signal
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade import Limits, Sandbox
from stockade import exceptions as exc
from stockade.sandbox.docker import DockerBackend
from tests.conftest import host_processes, require, require_tier, shared_host, wait_for

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine() -> Any:
    require_tier("docker")
    import docker

    client = docker.from_env(version="auto")
    yield client.api
    client.close()


def our_containers(api: Any) -> list[dict[str, Any]]:
    """Containers this test process created (running or not)."""
    return [
        c
        for c in api.containers(all=True, filters={"label": "stockade.sandbox=1"})
        if c["Labels"].get("stockade.pid") == str(os.getpid())
    ]


def supervisors_on_host(containers: set[str]) -> list[int]:
    """Supervisor processes of runc containers are host processes: those in ``containers``.

    Only ours: other sandboxes on a shared host come and go meanwhile.
    """
    found = []
    for pid in host_processes(b"import boot; boot.main()"):
        with contextlib.suppress(OSError):
            if any(cid in Path(f"/proc/{pid}/cgroup").read_text() for cid in containers):
                found.append(pid)
    return found


def test_a_container_killed_from_outside_is_reported(engine: Any) -> None:
    sbx = Sandbox.create("docker")
    assert sbx.commands.run("echo up").stdout == "up\n"
    (found,) = [c for c in our_containers(engine) if c["Labels"]["stockade.id"] == sbx.id]
    engine.kill(found["Id"])
    with pytest.raises(exc.SandboxCrashed, match=r"(stopped|removed) from outside") as caught:
        sbx.commands.run("echo still here?")
    assert not caught.value.retryable
    assert not sbx.alive
    sbx.close()
    assert our_containers(engine) == []


def test_create_close_cycles_leave_nothing_behind(engine: Any) -> None:
    containers = set()
    fds_warm = 0
    # 20 past warm: a descriptor left per sandbox is 20, far past the +2. Warm by the 20th: the
    # client's connection pools grow to what the engine's pace needs within the first four
    # cycles (one a cycle, then none: counted over 100 cycles), so 20 is margin, not need.
    for i in range(40):
        if i == 20:
            fds_warm = len(os.listdir("/proc/self/fd"))
        with Sandbox.create("docker", limits=Limits(timeout_s=10)) as sbx:
            containers.add(sbx.instance.boundary.cid)  # type: ignore[attr-defined]
            if i % 20 == 0:
                assert sbx.commands.run("echo ok").stdout == "ok\n"
    assert our_containers(engine) == []
    assert supervisors_on_host(containers) == []
    assert len(os.listdir("/proc/self/fd")) <= fds_warm + 2, "20 more sandboxes, more descriptors"


def test_an_exception_inside_the_block_still_removes_the_container(engine: Any) -> None:
    with pytest.raises(RuntimeError), Sandbox.create("docker"):
        raise RuntimeError("boom")
    assert our_containers(engine) == []


def test_a_forgotten_sandbox_is_removed_when_garbage_collected(engine: Any) -> None:
    Sandbox.create("docker").commands.run("true")
    gc.collect()
    assert our_containers(engine) == []


def test_gc_removes_containers_of_a_dead_process(engine: Any) -> None:
    script = (
        "from stockade import Sandbox; import os; "
        "s = Sandbox.create('docker'); print(s.id, flush=True); os._exit(0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    sid = out.stdout.strip()
    left = [c for c in engine.containers(all=True, filters={"label": f"stockade.id={sid}"})]
    assert len(left) == 1, "os._exit skips every cleanup: the container is left behind"
    from stockade.sandbox import _gc

    removed = _gc.collect()
    assert any(sid in line for line in removed)
    assert engine.containers(all=True, filters={"label": f"stockade.id={sid}"}) == []


def _dockerd_pid() -> int | None:
    try:
        pid = int(Path("/var/run/docker.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@pytest.mark.slow
# The host's engine is stopped: a test of another worker using it meanwhile would fail (and
# collect the sockets docker-py leaks when connect() is refused, a warning in that test).
@pytest.mark.alone
# docker-py's unix-socket connection leaks its socket when connect() is refused (engine down).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_dockerd_stopping_mid_run_is_retryable_and_leaks_nothing(engine: Any) -> None:
    if shared_host():  # said, not silent: CI never shares its host
        pytest.skip("it stops the host's dockerd, which the others on this shared host use")
    pid = _dockerd_pid()
    require(
        "a dockerd this test may restart",
        pid is not None and os.geteuid() == 0,
        "needs root and /var/run/docker.pid",
    )
    assert pid is not None
    sbx = Sandbox.create("docker")
    assert sbx.run_code("x = 1").error is None
    try:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: _dockerd_pid() is None, what="dockerd to stop", timeout_s=60, interval_s=0.2)
        with pytest.raises(exc.StockadeError) as during:
            sbx.run_code("x")
        assert during.value.retryable, repr(during.value)
        sbx.close()
        with pytest.raises(exc.BackendUnavailable) as creating:
            Sandbox.create("docker")
        assert creating.value.retryable
        del during, creating  # their tracebacks hold docker-py's leaked sockets ...
        gc.collect()  # ... finalised here, while the filters above apply
    finally:
        subprocess.run(
            ["bash", str(ROOT / "scripts/setup-docker.sh")], check=True, timeout=120, capture_output=True
        )
    # Back up: the next start removes what could not be removed while the engine was down.
    with Sandbox.create("docker") as again:
        assert again.commands.run("echo back").stdout == "back\n"
    assert our_containers(engine) == []


@pytest.fixture
def image_without_python(engine: Any) -> Iterator[str]:
    """An image of one empty /tmp: no python to compile the supervisor with (removed after)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
    repository, tag = "stockade-test-no-python", secrets.token_hex(4)
    engine.import_image_from_data(buf.getvalue(), repository=repository, tag=tag)
    yield f"{repository}:{tag}"
    engine.remove_image(f"{repository}:{tag}")


def test_a_supervisor_left_uncompiled_is_logged_once_with_why(
    image_without_python: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Without bytecode each start compiles the supervisor's modules: the backend says so
    # once (not at every start), with the engine's reason.
    backend = DockerBackend(image=image_without_python, state_dir=tmp_path)
    for _ in range(2):
        with pytest.raises(exc.ConfigurationError, match="python3"):
            Sandbox.create(backend=backend, limits=Limits(timeout_s=10))
    (logged,) = [r.getMessage() for r in caplog.records if "bytecode" in r.getMessage()]
    assert image_without_python in logged and '"python3": executable file not found' in logged
    assert "compiles its modules as it starts instead" in logged
