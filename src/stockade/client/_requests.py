"""What the clients send the service: the bodies and queries of its calls, each checked as the
local SDK checks it (``stockade._checks`` and the ``_requests`` builders, called) and as text
the wire can carry (``_inputs``). Apart from the answers: both clients, sync and asyncio,
build the same requests, and a wrong argument fails here before any request is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._checks import check_envs, check_id, check_labels
from stockade.client import _inputs
from stockade.sandbox._requests import code_op, command_op, range_op, upload_op
from stockade.sandbox.facade import tar_directory
from stockade.types import Limits, NetworkPolicy, Snapshot, Trust

__all__ = [
    "archive_params", "code_body", "command_body", "create_body", "limits_body", "path_params",
    "range_params", "snapshot_id", "upload_body",
]  # fmt: skip


def snapshot_id(snapshot: Snapshot | str) -> str:
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    if isinstance(snapshot, str):
        return check_id(snapshot, argument="snapshot")
    raise exc.InvalidArgument(
        f"snapshot must be a Snapshot or its id, got {type(snapshot).__name__}", argument="snapshot"
    )


def limits_body(limits: Limits | None) -> dict[str, Any] | None:
    """A ``Limits`` as the service takes it (a sandbox's, a run's sandbox's)."""
    if limits is None:
        return None
    if not isinstance(limits, Limits):
        raise exc.InvalidArgument(
            f"limits must be a Limits, got {type(limits).__name__}", argument="limits",
            fix="give Limits(memory_mb=..., timeout_s=...)",
        )  # fmt: skip
    body = {k: v for k, v in dataclasses.asdict(limits).items() if v is not None}
    if body["approval_wait_s"] == Limits.approval_wait_s:  # a service older than it refuses the field
        del body["approval_wait_s"]
    return body


def _network(network: NetworkPolicy) -> dict[str, Any]:
    """What the service is told of a network: on or off, and the hosts. The rest (ports and
    methods, addresses, limits, credentials) is the tenant policy's to say; the service
    applies its own, so a client's would be dropped without a word: refused instead."""
    extra = [
        name
        for name in ("rules", "allow_addresses", "resolve", "credentials", "upstream_ca",
                     "max_requests_per_minute", "max_bytes_per_minute")
        if getattr(network, name) != getattr(_NO_NETWORK, name)
    ]  # fmt: skip
    if extra:
        raise exc.InvalidArgument(
            f"a remote sandbox's network is its hosts alone; {', '.join(extra)} come from the "
            "tenant's policy on the service",
            argument="network",
            fix='NetworkPolicy(allow_hosts=("pypi.org",)); put ports, methods and credentials in the '
            "tenant's policy ([network] allow, [credentials])",
        )
    return {"enabled": network.enabled, "allow_hosts": list(network.allow_hosts)}


_NO_NETWORK = NetworkPolicy()


def create_body(
    tier: str | None, *, trust: Trust | str | None, limits: Limits | None, network: NetworkPolicy | None,
    envs: Mapping[str, str] | None, allow_weaker: bool, labels: Mapping[str, str] | None,
    prefer: str | None, idle_timeout_s: float | None, snapshot: Snapshot | str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The body of ``POST /v1/sandboxes``."""
    body: dict[str, Any] = {
        "tier": tier, "trust": str(trust) if trust is not None else None, "limits": limits_body(limits),
        "envs": check_envs(envs), "allow_weaker": allow_weaker, "labels": check_labels(labels),
        "prefer": prefer, "idle_timeout_s": idle_timeout_s,
        "snapshot": snapshot_id(snapshot) if snapshot is not None else None,
    }  # fmt: skip
    if network is not None:
        if not isinstance(network, NetworkPolicy):
            raise exc.InvalidArgument(
                f"network must be a NetworkPolicy, got {type(network).__name__}", argument="network",
                fix='give NetworkPolicy(allow_hosts=("pypi.org",))',
            )  # fmt: skip
        body["network"] = _network(network)
    return {k: v for k, v in body.items() if v is not None}


def command_body(
    cmd: str | Sequence[str], *, cwd: str | None, envs: Mapping[str, str] | None, timeout_s: float | None,
    stdin: str | bytes | bytearray | memoryview | None,
) -> dict[str, Any]:  # fmt: skip
    """The body of a command: checked as the local SDK checks it (``command_op``), and as text
    the service can take (UTF-8; stdin bytes only when they are UTF-8)."""
    argv = _inputs.argv(cmd)
    cwd = None if cwd is None else _inputs.text(cwd, "cwd")
    text = _inputs.stdin_text(stdin)
    op = command_op(argv, cwd, check_envs(envs), timeout_s, text)
    return {"cmd": argv, "cwd": cwd, "envs": dict(op.envs), "timeout_s": op.timeout_s, "stdin": text}


def code_body(code: str, language: str, timeout_s: float | None) -> dict[str, Any]:
    """The body of a ``run_code``: checked as the local SDK checks it (``code_op``), in UTF-8."""
    for value, argument in ((code, "code"), (language, "language")):
        if isinstance(value, str):
            _inputs.utf8(value, argument)
    op = code_op(code, language, timeout_s)
    return {"code": code, "language": language, "timeout_s": op.timeout_s}


def path_params(path: object, **more: object) -> dict[str, Any]:
    """A files call's query: the path checked as the local SDK checks it, in UTF-8."""
    return {"path": _inputs.path(path), **more}


def archive_params(dest: object, *, source: object, max_bytes: object, max_entries: object) -> dict[str, Any]:
    """A download's query, once ``dest`` is a host path (the limits: ``Extraction`` checks them)."""
    _inputs.host_path(dest, "dest")
    return path_params(source, max_bytes=max_bytes, max_entries=max_entries)


def upload_body(
    source: str | Path, dest: str, hide: Sequence[str], read: Sequence[str]
) -> tuple[dict[str, Any], bytes]:
    """An upload's query and tar: the local SDK's ``upload_op`` checks (a folder, a workspace
    ``dest``); the tar is whole (the service takes one body)."""
    op = upload_op(_inputs.folder(source, "source"), _inputs.path(dest, "dest"), hide, read)
    folder = op.folder
    assert folder is not None  # upload_op's is a host folder's
    return {"path": op.path}, tar_directory(folder.source, folder.hide, folder.read)


def range_params(path: object, offset: object, length: object) -> dict[str, Any]:
    op = range_op(_inputs.path(path), _inputs.offset(offset, "offset"), _inputs.offset(length, "length"))
    return {"path": op.path, "offset": op.offset, "length": op.length}
