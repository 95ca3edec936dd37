"""The remote sandboxes have the local ones' surface (``stockade.client``): the same methods
and properties, the same parameters with the same defaults, async where the local one is, so
that moving code to the service is the one import line."""

from __future__ import annotations

import inspect

import pytest

from stockade import AsyncSandbox, Sandbox
from stockade.client import (
    AsyncClient,
    AsyncRemoteRun,
    AsyncRemoteSandbox,
    AsyncRuns,
    Client,
    RemoteRun,
    RemoteSandbox,
    Runs,
)
from stockade.client.async_sandbox import AsyncRemoteCommands, AsyncRemoteFiles
from stockade.client.sandbox import RemoteCommands, RemoteFiles
from stockade.sandbox._namespaces import AsyncCommands, AsyncFiles, Commands, Files

# what only a local sandbox can take: the engine itself, the host-side hooks of the policy, and
# a snapshot store (the service keeps each tenant's snapshots in a store of its own)
LOCAL_ONLY = {"backend", "rules", "approver", "instance", "store"}

PAIRS = [
    (Sandbox, RemoteSandbox),
    (Commands, RemoteCommands),
    (Files, RemoteFiles),
    (AsyncSandbox, AsyncRemoteSandbox),
    (AsyncCommands, AsyncRemoteCommands),
    (AsyncFiles, AsyncRemoteFiles),
]


def public(cls: type) -> dict[str, object]:
    return {
        name: value
        for klass in reversed(cls.__mro__[:-1])
        for name, value in vars(klass).items()
        if not name.startswith("_") or name in ("__enter__", "__exit__", "__aenter__", "__aexit__")
    }


@pytest.mark.parametrize(("local", "remote"), PAIRS, ids=lambda c: c.__name__)
def test_every_local_method_and_property_is_there_remotely(local: type, remote: type) -> None:
    missing = sorted(set(public(local)) - set(public(remote)) - LOCAL_ONLY)
    assert not missing, f"{remote.__name__} lacks {missing}"


@pytest.mark.parametrize(("local", "remote"), PAIRS, ids=lambda c: c.__name__)
def test_the_same_parameters_with_the_same_defaults_async_where_local_is(local: type, remote: type) -> None:
    theirs = public(remote)
    for name, value in public(local).items():
        if name in LOCAL_ONLY or isinstance(value, property):
            continue
        function = value.__func__ if isinstance(value, classmethod) else value
        other = theirs[name]
        other = other.__func__ if isinstance(other, classmethod) else other
        assert callable(function) and callable(other), name
        assert inspect.iscoroutinefunction(function) == inspect.iscoroutinefunction(other), name
        mine = inspect.signature(function).parameters
        remote_params = inspect.signature(other).parameters
        for param in mine.values():
            if param.name in LOCAL_ONLY:
                continue
            assert param.name in remote_params, f"{remote.__name__}.{name} has no {param.name!r}"
            there = remote_params[param.name]
            assert there.kind == param.kind, f"{remote.__name__}.{name}({param.name})"
            if param.default is not inspect.Parameter.empty and param.name != "prefer":
                assert there.default == param.default, f"{remote.__name__}.{name}({param.name})"
        extra = [
            p for p in remote_params.values() if p.name not in mine and p.default is inspect.Parameter.empty
        ]
        assert not extra, f"{remote.__name__}.{name} requires {extra} more than the local one"


def test_properties_stay_properties() -> None:
    for local, remote in PAIRS:
        for name, value in public(local).items():
            if isinstance(value, property) and name not in LOCAL_ONLY:
                assert isinstance(public(remote)[name], property), f"{remote.__name__}.{name}"


def test_a_remote_network_is_its_hosts_and_the_rest_is_refused_not_dropped() -> None:
    from stockade.client._requests import create_body
    from stockade.exceptions import InvalidArgument
    from stockade.types import HostRule, NetworkPolicy

    def body(network: NetworkPolicy) -> dict[str, object]:
        return create_body(
            None, network=network, trust=None, limits=None, envs=None, allow_weaker=False, labels=None,
            prefer=None, idle_timeout_s=None,
        )  # fmt: skip

    assert body(NetworkPolicy(allow_hosts=("pypi.org",)))["network"] == {
        "enabled": False,
        "allow_hosts": ["pypi.org"],
    }
    with pytest.raises(InvalidArgument, match="rules"):  # ports and methods: the tenant's policy
        body(NetworkPolicy(rules=(HostRule(host="pypi.org", ports=(8443,)),)))


# The async client is the sync one with ``await``: the same methods (``events`` an async
# iterator), the same parameters and defaults; ``close``/``__enter__`` are asyncio's.
SYNC_ASYNC = [(Client, AsyncClient), (Runs, AsyncRuns), (RemoteRun, AsyncRemoteRun)]
CONTEXT = {"close", "__enter__", "__exit__", "sandbox"}  # sandbox(): checked with the sandboxes above


@pytest.mark.parametrize(("sync", "async_"), SYNC_ASYNC, ids=lambda c: c.__name__)
def test_the_async_client_is_the_sync_one_awaited(sync: type, async_: type) -> None:
    theirs = public(async_)
    for name, value in public(sync).items():
        if name in CONTEXT or name == "__repr__":
            continue
        assert name in theirs, f"{async_.__name__} lacks {name}"
        if isinstance(value, property):
            assert isinstance(theirs[name], property), f"{async_.__name__}.{name}"
            continue
        other = theirs[name]
        assert callable(value) and callable(other), name
        if inspect.isgeneratorfunction(value):
            assert inspect.isasyncgenfunction(other), f"{async_.__name__}.{name} is not an async iterator"
        else:
            assert inspect.iscoroutinefunction(other), f"{async_.__name__}.{name} is not async"
        mine, there = inspect.signature(value).parameters, inspect.signature(other).parameters
        assert list(mine) == list(there), f"{async_.__name__}.{name}"
        for param in mine.values():
            assert there[param.name].default == param.default, f"{async_.__name__}.{name}({param.name})"
