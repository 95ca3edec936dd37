"""Which engines count as remote: those that cannot see this host's files."""

from __future__ import annotations

import pytest

from stockade.sandbox.docker import DockerBackend


@pytest.fixture(autouse=True)
def no_docker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.delenv("STOCKADE_DOCKER_REMOTE", raising=False)


def test_a_unix_socket_is_local_and_tcp_is_remote() -> None:
    assert not DockerBackend().remote
    assert not DockerBackend(base_url="unix:///var/run/docker.sock").remote
    assert DockerBackend(base_url="tcp://10.0.0.2:2376").remote
    assert DockerBackend(base_url="ssh://builder@example.org").remote


def test_docker_host_decides_when_no_url_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://10.0.0.2:2376")
    assert DockerBackend().remote


def test_the_mode_can_be_forced_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DockerBackend(remote=True).remote
    assert not DockerBackend(base_url="tcp://127.0.0.1:2375", remote=False).remote
    monkeypatch.setenv("STOCKADE_DOCKER_REMOTE", "1")
    assert DockerBackend().remote


def test_a_remote_gvisor_engine_cannot_mount_host_tmpfs() -> None:
    backend = DockerBackend(runtime="runsc", own_kernel=True, base_url="tcp://10.0.0.2:2376")
    assert not backend.host_tmpfs
