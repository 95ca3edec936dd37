"""The Docker tier against an engine that cannot see this host's files.

A remote engine (``DOCKER_HOST=tcp://...``) gets the supervisor through a Docker volume
filled over the API, and counts OOM kills from the engine's events instead of this host's
cgroups. ``remote=True`` forces that mode on the local engine: the code path is the same,
and no engine has to listen on TCP (an unauthenticated engine socket is root for whoever
can reach it, loopback included).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from typing import Any

import pytest

from stockade import LimitNotEnforceable, Limits, Sandbox
from stockade.sandbox import _guest
from stockade.sandbox.docker import DockerBackend
from stockade.types import Mechanism
from tests.conftest import require_tier

pytestmark = pytest.mark.docker


@pytest.fixture
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerBackend]:
    """The mode, and the supervisor's volumes it made removed after (the suite leaves no trace;
    a user's engine keeps its volume: one per supervisor version, filled once). The tests of
    this mode take turns across a parallel run's workers (a lock file of the run's): one's new
    volume, removed at its end, was in use by another's container (409), or would be removed
    from under it, and then no test removed it."""
    require_tier("docker")
    with open(tmp_path_factory.getbasetemp().parent / "docker-remote.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # released as the file closes
        backend = DockerBackend(remote=True)
        api = backend._api()
        before = {v["Name"] for v in api.volumes(filters={"label": _guest.LABEL}).get("Volumes") or []}
        yield backend
        for volume in api.volumes(filters={"label": _guest.LABEL}).get("Volumes") or []:
            if volume["Name"] not in before:
                api.remove_volume(volume["Name"])


def mounts_of(backend: DockerBackend, sbx: Sandbox) -> dict[str, dict[str, Any]]:
    api = backend._api()
    (found,) = api.containers(filters={"label": f"stockade.id={sbx.id}"})
    return {m["Destination"]: m for m in api.inspect_container(found["Id"])["Mounts"]}


def test_a_remote_engine_gets_the_supervisor_in_a_volume(remote: DockerBackend) -> None:
    with Sandbox.create(backend=remote, limits=Limits(timeout_s=10), allow_weaker=True) as sbx:
        kernel = mounts_of(remote, sbx)["/opt/stockade"]
        assert kernel["Type"] == "volume" and not kernel["RW"]
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
        # bytecode the image's own python compiled travels with the volume (unchecked-hash
        # pycs: the supervisor loads them; the interpreter forgets our modules, so look at files)
        cached = sbx.commands.run(["ls", "/opt/stockade/__pycache__"]).stdout.split()
        assert any(name.startswith("supervisor.") and name.endswith(".pyc") for name in cached)
        assert sbx.commands.run("touch /opt/stockade/x").exit_code != 0
        sbx.files.write("a.txt", "hello")
        assert sbx.commands.run("cat a.txt").stdout == "hello"


def test_a_remote_engine_cannot_bound_ptys_and_says_so(remote: DockerBackend) -> None:
    """The host bounds a container's devpts from beside the engine: a remote one's ptys are
    bounded by its host's kernel.pty.max only, which needs the caller's consent."""
    with pytest.raises(LimitNotEnforceable) as refused:
        Sandbox.create(backend=remote, limits=Limits(timeout_s=10))
    assert refused.value.setting == "ptys"
    with Sandbox.create(backend=remote, limits=Limits(timeout_s=10), allow_weaker=True) as sbx:
        assert sbx.enforcement.ptys is Mechanism.NONE
        assert any(w.startswith("ptys") for w in sbx.enforcement.weakened), sbx.enforcement


def test_a_remote_engine_reports_oom_kills_from_its_events(remote: DockerBackend) -> None:
    with Sandbox.create(backend=remote, limits=Limits(memory_mb=128, timeout_s=20), allow_weaker=True) as sbx:
        r = sbx.commands.run("python3 -c \"x = b'a' * (512 << 20); print('allocated')\"")
        assert "allocated" not in r.stdout
        assert r.oom_killed
        assert not sbx.commands.run("true").oom_killed
