"""A folder uploaded through the service (``PUT /v1/sandboxes/{id}/archive``, ``POST
/v1/workspaces``) and through the local SDK (``files.upload_dir``): a tree deeper than an
archive of a workspace takes is ``TreeTooDeep`` on every route, refused before it is unpacked,
and the service's scratch folder goes whatever happens (a RecursionError left each request's
copy on the host's disk, its claim held, so gc skipped it while the server ran)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2
import pytest

from stockade import Sandbox
from stockade import exceptions as exc
from stockade.client._http import error_from
from stockade.server.app import create_app
from stockade.server.context import ServiceConfig
from stockade.server.service import Service
from stockade.server.tenants import Tenants
from tests.conftest import require_tier
from tests.integration.service_env import write_tenants

pytestmark = [pytest.mark.process]

MiB = 1024 * 1024


def deep_tar(depth: int, size: int = MiB) -> bytes:
    """A tar of ``size`` bytes in a file under ``depth`` nested folders ``a/a/...``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        name = ""
        for _ in range(depth):
            name += "a/"
            info = tarfile.TarInfo(name.rstrip("/"))
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        info = tarfile.TarInfo(name + "big")
        info.size = size
        tar.addfile(info, io.BytesIO(bytes(size)))
    return buffer.getvalue()


@pytest.fixture
def scratch_parent(tmp_path: Path) -> Path:
    (tmp_path / "scratch").mkdir()
    return tmp_path / "scratch"


@pytest.fixture
def service(tmp_path: Path, scratch_parent: Path) -> Iterator[tuple[Service, str]]:
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    config = ServiceConfig(
        tenants=Tenants.load(tenants), database=f"sqlite:///{tmp_path / 'service.db'}",
        temp_dir=scratch_parent,
    )  # fmt: skip
    service = Service(config)
    try:
        yield service, tokens.acme
    finally:
        service.close()


@pytest.fixture
async def http(service: tuple[Service, str]) -> AsyncIterator[httpx2.AsyncClient]:
    transport = httpx2.ASGITransport(app=create_app(service[0]))
    headers = {"Authorization": f"Bearer {service[1]}"}
    async with httpx2.AsyncClient(
        transport=transport, base_url="http://service", headers=headers, timeout=120
    ) as client:
        yield client


def refused_deep(response: httpx2.Response) -> exc.StockadeError:
    assert response.status_code == 422, response.text
    error = error_from(response.json(), response.status_code)
    assert isinstance(error, exc.TreeTooDeep), response.text
    return error


async def test_a_deep_tree_uploaded_to_a_sandbox_is_refused_and_leaves_no_scratch(
    http: httpx2.AsyncClient, scratch_parent: Path
) -> None:
    made = await http.post("/v1/sandboxes", json={"tier": "process"})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["id"]
    try:
        for _ in range(3):  # each request's copy went; before, each left ~its size behind
            response = await http.put(
                f"/v1/sandboxes/{sandbox_id}/archive", params={"path": "d1"}, content=deep_tar(1_100),
                headers={"Content-Type": "application/x-tar"},
            )  # fmt: skip
            refused_deep(response)
            assert list(scratch_parent.iterdir()) == []
        # one as deep as an archive takes is uploaded
        ok = await http.put(
            f"/v1/sandboxes/{sandbox_id}/archive", params={"path": "d2"}, content=deep_tar(127, 10),
            headers={"Content-Type": "application/x-tar"},
        )  # fmt: skip
        assert ok.status_code == 204, ok.text
        assert list(scratch_parent.iterdir()) == []
    finally:
        await http.delete(f"/v1/sandboxes/{sandbox_id}")


async def test_a_deep_workspace_upload_is_refused_and_leaves_no_scratch(
    http: httpx2.AsyncClient, scratch_parent: Path
) -> None:
    response = await http.post(
        "/v1/workspaces", content=deep_tar(1_100), headers={"Content-Type": "application/x-tar"}
    )
    refused_deep(response)
    assert list(scratch_parent.iterdir()) == []


def test_the_local_sdks_upload_of_a_deep_folder_is_too_deep(tmp_path: Path) -> None:
    require_tier("process")
    folder = tmp_path / "up"
    deepest = folder
    folder.mkdir()
    for _ in range(1_200):
        deepest = deepest / "a"
        deepest.mkdir()
    try:
        with Sandbox.create("process") as sbx:
            with pytest.raises(exc.TreeTooDeep):
                sbx.files.upload_dir(folder, "deep")
            assert not sbx.files.exists("deep/a")  # refused before a byte was sent
    finally:
        while deepest != tmp_path:  # bottom up: shutil.rmtree (tmp_path's) recurses
            deepest.rmdir()
            deepest = deepest.parent
