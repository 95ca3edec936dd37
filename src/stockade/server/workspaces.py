"""Workspaces over HTTP: upload one (a tar or tar.gz) for runs to start from, list them,
delete one. An uploaded workspace is its role's: another role lists none of it, deletes none
of it (404), and a run of that role cannot start from it; its bytes count against the
tenant's ``storage_mb``. Apart from the runs' routes: it is stored bytes, not a run, and a run
reads it only by its id (``runs.py`` checks it at submission).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response

from stockade import exceptions as exc
from stockade.runs.seeds import pack_workspace
from stockade.server.bodies import JSONRoute, raw_body, read_body
from stockade.server.deps import Caller, get_service
from stockade.server.held import unpacking
from stockade.server.run_views import blocking, owns
from stockade.server.schemas import WorkspaceInfo, WorkspaceOut
from stockade.server.scratch import scratch
from stockade.server.uploads import unpack_within
from stockade.types import MiB

__all__ = ["router"]

router = APIRouter(tags=["runs"], route_class=JSONRoute)


@router.post("/v1/workspaces", status_code=201, response_model=WorkspaceOut, tags=["runs"],
             summary="Upload a workspace (a tar or tar.gz) for runs to start from")  # fmt: skip
@raw_body
async def upload_workspace(request: Request, caller: Caller) -> WorkspaceOut:
    service = get_service(request)
    cap = service.config.max_upload_bytes
    data = await read_body(request, cap, caller)

    def work(room: int) -> WorkspaceOut:
        with scratch("workspace", service.config.temp_dir) as tmp:
            files = unpack_within(data, Path(tmp) / "in", room, cap)
            seed = pack_workspace(Path(tmp) / "in", max_bytes=cap)
        service.store.put_workspace(
            caller.tenant.id,
            caller.role,
            seed.digest,
            seed.data,
            len(seed.data),
            max_bytes=caller.tenant.quotas.storage_mb * MiB,
        )
        return WorkspaceOut(id=seed.digest, bytes=len(seed.data), files=files)

    # one of the tenant's calls (its unpacking holds a server thread), its files counted
    with unpacking(request, caller, cap) as room:
        out: WorkspaceOut = await service.sandboxes.calls.run(caller.tenant, lambda: work(room))
    return out


@router.get("/v1/workspaces", response_model=list[WorkspaceInfo], tags=["runs"],
            summary="Your uploaded workspaces, newest first")  # fmt: skip
async def list_workspaces(request: Request, caller: Caller) -> list[WorkspaceInfo]:
    service = get_service(request)
    rows = await blocking(lambda: service.store.workspaces(caller.tenant.id, caller.role))
    return [WorkspaceInfo(id=digest, bytes=size, uploaded_at=ns / 1e9) for digest, size, ns in rows]


@router.delete("/v1/workspaces/{workspace_id}", status_code=204, tags=["runs"],
               summary="Delete an uploaded workspace (its bytes leave your storage_mb)")  # fmt: skip
async def delete_workspace(workspace_id: str, request: Request, caller: Caller) -> Response:
    service = get_service(request)

    def work() -> None:
        tenant = caller.tenant.id
        if service.store.workspace_size(tenant, caller.role, workspace_id) is None:
            raise exc.ResourceNotFound(f"no workspace {workspace_id!r}", kind="workspace", id=workspace_id)
        users = [
            r.run_id for r in service.store.open_runs(tenant)
            if owns(caller, r) and r.spec.get("workspace") == workspace_id
        ]  # fmt: skip
        if users:  # they start, and resume, from it (another role's run starts from its own copy)
            raise exc.RunConflict(
                f"workspace {workspace_id} is the start of run {users[0]}, which has not ended: "
                "wait for it, or kill it first"
            )
        if not service.store.delete_workspace(tenant, caller.role, workspace_id):
            raise exc.ResourceNotFound(f"no workspace {workspace_id!r}", kind="workspace", id=workspace_id)

    await blocking(work)
    return Response(status_code=204)
