"""Sandboxes over HTTP: ``stockade.Sandbox`` behind ``/v1/sandboxes``.

These routes are a sandbox's life (create, list, get, kill, snapshot, pause, resume, delete)
and its calls (commands, code, reset); its files and folders are ``server/sandbox_files.py``'s,
and the live sandboxes themselves, with their quota and their process, ``server/sandbox_registry.py``'s.

A sandbox belongs to the role of the token that made it: the tokens of that role use it; to
another role of the tenant it is as another tenant's, not found (404) on every route, and so
are its snapshots and its pause (``server/snapshots.py``). The role's policy was asked what
the sandbox may hold (``[data_access]`` above a role never enters it), so another role must
not read it there. Each call amounts to one of the agent's tools (``authz.SANDBOX_TOOLS``:
a command is ``shell``, code ``run_code``, a write ``write_file``, ...) and is refused (403,
rule ``roles.<role>.tools``) when the role's ``tools`` leave it out, as a run's call would be.

Command output streams as NDJSON (``"stream": true``): one JSON object a line,
``{"type": "stdout"|"stderr", "data": TEXT}`` as the output comes, then
``{"type": "result", "result": {...CommandResult or Execution...}}`` or
``{"type": "error", "problem": {...}}`` last. A client that reads slower than the call prints
misses output past ``STREAM_BUFFER_CHARS`` waiting here: a
``{"type": "skipped", "stdout": N, "stderr": M}`` line (characters) marks where; the result
holds all of it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.encoders import jsonable_encoder

from stockade import exceptions as exc
from stockade.server.authz import check_sandbox_tool
from stockade.server.bodies import JSONRoute
from stockade.server.deps import Caller, recheck
from stockade.server.held import HeldResponse, held_bytes
from stockade.server.sandbox_calls import blocking, call, registry_of
from stockade.server.sandbox_registry import BEAT_S, DEAD_AFTER_S, Held, SandboxRegistry
from stockade.server.schemas import (
    CodeRequest,
    CommandRequest,
    SandboxCreate,
    SandboxOut,
    SnapshotOut,
    SnapshotRequest,
)
from stockade.server.streamed import streamed
from stockade.server.tenants import Principal
from stockade.types import CommandResult, Execution

__all__ = ["BEAT_S", "DEAD_AFTER_S", "Held", "SandboxRegistry", "router"]

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], route_class=JSONRoute)


@router.post("", status_code=201, response_model=SandboxOut, summary="Create a sandbox")
async def create_sandbox(body: SandboxCreate, request: Request, caller: Caller) -> SandboxOut:
    registry = registry_of(request)
    held: Held = await call(request, caller, lambda: registry.create(caller, body))
    return held.out()


@router.get("", response_model=list[SandboxOut], summary="List your sandboxes")
async def list_sandboxes(request: Request, caller: Caller) -> list[SandboxOut]:
    from stockade.server.routing import HOP_HEADER, peers_of

    registry = registry_of(request)
    found = [h.out() for h in registry.of(caller)]
    if HOP_HEADER not in request.headers:  # a peer asks only for this process's own
        found += await peers_of(request, caller)
    return found


@router.get("/{sandbox_id}", response_model=SandboxOut, summary="One sandbox")
async def get_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = registry_of(request)
    try:
        return registry.get(caller, sandbox_id).out()
    except exc.ResourceNotFound:
        # no process holds a paused sandbox (routing left it here): the tenant's store does
        paused: SandboxOut | None = await blocking(lambda: registry.paused(caller, sandbox_id))
        if paused is None:
            raise
        return paused


@router.post("/{sandbox_id}/kill", response_model=SandboxOut, summary="Stop a sandbox now, mid-command too")
async def kill_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = registry_of(request)
    held: Held = await blocking(lambda: registry.kill(caller, sandbox_id))
    return held.out()


@router.post("/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotOut,
             summary="Save the sandbox (files, or memory where the tier can) and let it run on")  # fmt: skip
async def take_snapshot(
    sandbox_id: str, request: Request, caller: Caller, body: SnapshotRequest | None = None
) -> SnapshotOut:
    registry = registry_of(request)
    memory = body.memory if body is not None else None
    taken: SnapshotOut = await call(request, caller, lambda: registry.snapshot(caller, sandbox_id, memory))
    return taken


@router.post("/{sandbox_id}/pause", response_model=SnapshotOut,
             summary="Save the sandbox and stop it; POST .../resume brings it back under its id")  # fmt: skip
async def pause_sandbox(
    sandbox_id: str, request: Request, caller: Caller, body: SnapshotRequest | None = None
) -> SnapshotOut:
    registry = registry_of(request)
    memory = body.memory if body is not None else None
    paused: SnapshotOut = await call(request, caller, lambda: registry.pause(caller, sandbox_id, memory))
    return paused


@router.post("/{sandbox_id}/resume", response_model=SandboxOut, summary="Run a paused sandbox again")
async def resume_sandbox(sandbox_id: str, request: Request, caller: Caller) -> SandboxOut:
    registry = registry_of(request)
    held: Held = await call(request, caller, lambda: registry.resume(caller, sandbox_id))
    return held.out()


@router.delete("/{sandbox_id}", status_code=204, summary="Close and forget a sandbox")
async def delete_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    registry = registry_of(request)
    await blocking(lambda: registry.delete(caller, sandbox_id))
    return Response(status_code=204)


def _as_json(value: CommandResult | Execution) -> dict[str, Any]:
    return dataclasses.asdict(value)


async def _held_result(request: Request, caller: Principal, result: CommandResult | Execution) -> Response:
    """``result`` as JSON (encoded off the loop: its output may be tens of MiB), counted
    against the tenant's ``bodies_mb`` until its client has read it."""
    body: bytes = await blocking(lambda: json.dumps(
        jsonable_encoder(_as_json(result)), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode())  # fmt: skip
    hold = held_bytes(request).hold(caller.tenant, len(body), what="the result of a call that ran")
    return HeldResponse.of(body, hold=hold, media_type="application/json")


@router.post("/{sandbox_id}/commands", summary="Run a command (JSON, or NDJSON streamed while it runs)",
             response_model=None)  # fmt: skip
async def run_command(sandbox_id: str, body: CommandRequest, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "command")
    registry = registry_of(request)

    def work(
        on_stdout: Callable[[str], object] | None, on_stderr: Callable[[str], object] | None
    ) -> CommandResult:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.commands.run(
                body.cmd, cwd=body.cwd, envs=body.envs or None, timeout_s=body.timeout_s, stdin=body.stdin,
                on_stdout=on_stdout, on_stderr=on_stderr,
            )  # fmt: skip

    registry.get(caller, sandbox_id)  # 404 before a stream starts
    if body.stream:
        return streamed(request, caller, registry.calls, lambda out, err: _as_json(work(out, err)))
    result: CommandResult = await call(request, caller, lambda: work(None, None), cut_on_leave=True)
    await blocking(lambda: recheck(request, caller))  # the token may have gone while it ran
    return await _held_result(request, caller, result)


@router.post("/{sandbox_id}/code", summary="run_code (JSON, or NDJSON streamed while it runs)",
             response_model=None)  # fmt: skip
async def run_code(sandbox_id: str, body: CodeRequest, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "code")
    registry = registry_of(request)

    def work(
        on_stdout: Callable[[str], object] | None, on_stderr: Callable[[str], object] | None
    ) -> Execution:
        with registry.use(caller, sandbox_id) as sandbox:
            return sandbox.run_code(
                body.code, body.language, timeout_s=body.timeout_s, on_stdout=on_stdout, on_stderr=on_stderr
            )

    registry.get(caller, sandbox_id)
    if body.stream:
        return streamed(request, caller, registry.calls, lambda out, err: _as_json(work(out, err)))
    result: Execution = await call(request, caller, lambda: work(None, None), cut_on_leave=True)
    await blocking(lambda: recheck(request, caller))
    return await _held_result(request, caller, result)


@router.post("/{sandbox_id}/reset", status_code=204, summary="Kill every process, empty the workspace")
async def reset_sandbox(sandbox_id: str, request: Request, caller: Caller) -> Response:
    check_sandbox_tool(caller, "reset")
    registry = registry_of(request)

    def work() -> None:
        with registry.use(caller, sandbox_id) as sandbox:
            sandbox.reset()

    await call(request, caller, work)
    return Response(status_code=204)
