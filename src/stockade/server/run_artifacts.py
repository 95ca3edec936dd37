"""A run's workspace in and out: the seed it starts from (its role's upload), and the
artifacts it ends with (its final workspace packed, less what a copy on the host leaves out;
or, when its worker died before keeping them, rebuilt from the run store). Apart from the
runner's start, drive and end of a run, which only asks for them: ``RunArtifacts`` is the
base of ``Runner``, which sets up the stores it reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from stockade import exceptions as exc
from stockade.assembly import AgentSession
from stockade.runs.handback import prune_folder
from stockade.runs.seeds import pack_workspace, unpack_seed
from stockade.runs.store import RunStore
from stockade.server.context import ServiceConfig
from stockade.server.scratch import scratch
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant
from stockade.types import MiB

__all__ = ["LEFT_OUT", "MAX_ARTIFACT_BYTES", "RunArtifacts"]

log = logging.getLogger("stockade.runner")
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024
# Inside a run's artifacts: what they leave out of its workspace, a line per reason (a folder a
# copy carries, ``_state.CARRIED``; written only when something was left out).
LEFT_OUT = ".stockade/reports/left-out.txt"


class RunArtifacts:
    """The runner's part that reads a run's seed and keeps its artifacts."""

    config: ServiceConfig
    runs: RunStore
    store: ServiceStore

    @contextlib.contextmanager
    def _seed(self, tenant: Tenant, run_id: str, digest: str | None) -> Iterator[Path | None]:
        """The workspace the run starts from: its role's upload (checked when it was submitted).
        A run submitted before workspaces had a role (they were the tenant's) may start from
        one kept from then, which names no role."""
        with scratch("run", self.config.temp_dir) as tmp:
            if digest is None:
                yield None
                return
            row = self.store.run_head(run_id)
            role = row.role if row is not None else None
            data = self.store.workspace(tenant.id, role, digest)
            if data is None and role is not None:
                data = self.store.workspace(tenant.id, None, digest)
            if data is None:
                raise exc.ResourceNotFound(f"no workspace {digest!r}", kind="workspace", id=digest)
            unpack_seed(data, Path(tmp) / "workspace")
            yield Path(tmp) / "workspace"

    def _keep_artifacts(self, run_id: str, tenant: Tenant, session: AgentSession) -> None:
        """The final workspace, packed (what ``GET /v1/runs/{id}/artifacts`` returns), but what
        a copy on the host leaves out (``runs.handback``), named in ``LEFT_OUT`` inside it."""
        with scratch("artifacts", self.config.temp_dir) as tmp:
            out = Path(tmp) / "out"
            try:
                session.save_workspace(out)
                left = prune_folder(
                    out, seed=self.runs.seed_files(run_id), keep=session.owner.engine.hands_back
                )
                _name_left_out(out, left.lines())
            except (exc.StockadeError, OSError) as error:
                log.warning("run %s: its artifacts were not kept: %s", run_id, error)
                return
            self._put_artifacts(run_id, tenant, out)

    def _rebuild_artifacts(self, run_id: str, tenant: Tenant) -> None:
        """The artifacts of a run that ended without them: its last recorded workspace (each
        tool call records it, less what an export leaves out), or, a run that called no tool,
        the workspace it started from."""
        with scratch("artifacts", self.config.temp_dir) as tmp:
            out = Path(tmp) / "out"
            try:
                if self.runs.workspace_usage(run_id).versions:
                    exported = self.runs.export_workspace(run_id, out)
                    _name_left_out(out, exported.withheld.lines())
                else:
                    with self._seed(tenant, run_id, self._spec_workspace(run_id)) as seed:
                        if seed is None:
                            out.mkdir()
                        else:
                            shutil.copytree(seed, out, symlinks=True)
            except (exc.StockadeError, OSError) as error:
                log.warning("run %s: its artifacts were not rebuilt: %s", run_id, error)
                return
            self._put_artifacts(run_id, tenant, out)

    def _spec_workspace(self, run_id: str) -> str | None:
        workspace = (self.store.run_spec(run_id) or {}).get("workspace")
        return workspace if isinstance(workspace, str) else None

    def _put_artifacts(self, run_id: str, tenant: Tenant, folder: Path) -> None:
        try:
            seed = pack_workspace(folder, max_bytes=MAX_ARTIFACT_BYTES)
        except exc.StockadeError as error:
            log.warning("run %s: its artifacts were not kept: %s", run_id, error)
            return
        if not self.store.put_artifacts(
            run_id, seed.digest, seed.data, len(seed.data), max_bytes=tenant.quotas.storage_mb * MiB
        ):
            log.warning("run %s: its artifacts were not kept: its tenant's storage_mb quota is full", run_id)


def _name_left_out(out: Path, lines: list[str]) -> None:
    """Write ``LEFT_OUT`` into the artifacts' folder when anything was left out (over whatever
    the run's code put there)."""
    if not lines:
        return
    folder = out
    for part in Path(LEFT_OUT).parent.parts:  # never through a link the run's code left there
        folder = folder / part
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            folder.unlink()
        folder.mkdir(exist_ok=True)
    note = out / LEFT_OUT
    note.unlink(missing_ok=True)
    fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as file:
        file.write("\n".join(lines) + "\n")
