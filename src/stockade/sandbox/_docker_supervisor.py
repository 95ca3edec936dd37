"""The supervisor's files that containers mount at /opt/stockade, compiled once per image.

A part of ``DockerBackend``. A short-lived helper container of the image compiles the
supervisor with the image's own python, so that every start loads bytecode; with a remote
engine, which cannot see this host's files, a volume filled over the API holds them. None
of this is on a start's path once done: it is resolved once per backend.
"""

from __future__ import annotations

import io
import json
import logging
import secrets
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _builds, _guest
from stockade.sandbox._docker_engine import (
    docker_py,
    engine_failures,
    mapped_engine_errors,
    no_logs,
    remove_container,
)
from stockade.sandbox._docker_settings import START_TIMEOUT_S, DockerSettings
from stockade.sandbox.base import SandboxSpec

log = logging.getLogger(__name__)

# The compile helper's /tmp: a volume of its own, which the engine reads on its host whatever
# the runtime (gVisor keeps what a container writes to its root filesystem in its own kernel,
# out of the engine's reach). At /tmp, an empty volume takes the image's /tmp mode (1777).
WORK = "/tmp"
COMPILED = f"{WORK}/stockade-compiled.json"
COMPILE_ERRORS = f"{WORK}/stockade-compile.err"
MAX_COMPILED = 16 * 1024 * 1024
MAX_ERRORS = 2000  # the tail of a failed compile's stderr, in the log


def _tar(files: Mapping[str, bytes | str], folder: str = "") -> bytes:
    """A tar of world-readable files (and their folders) for ``put_archive``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dirs = {str(Path(folder, name).parent) for name in files} - {"."}
        for name in sorted(dirs):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(info)
        for name, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(str(Path(folder, name)))
            info.size, info.mode, info.mtime = len(raw), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _fetch_file(api: Any, cid: str, path: str) -> bytes:
    """One small file of a container (running or not), through the engine's archive API."""
    stream, _ = api.get_archive(cid, path)
    data = bytearray()
    for chunk in stream:
        data += chunk
        if len(data) > MAX_COMPILED + 64 * 1024:
            raise ValueError(f"{path} is larger than expected")
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        member = tar.next()
        handle = tar.extractfile(member) if member is not None else None
        if handle is None:
            raise ValueError(f"{path} is not a file")
        return handle.read(MAX_COMPILED)


class SupervisorFiles(DockerSettings):
    """The supervisor's files part of ``DockerBackend``."""

    def _supervisor_mount(self, api: Any) -> str:
        """What containers mount at /opt/stockade: the host's supervisor folder, or a volume.

        Once per image, its own python compiles the supervisor (a short-lived helper
        container), so that every start loads bytecode instead of compiling it. Resolved once
        per backend: no engine round trip on the start path (a tag moved meanwhile is seen
        by the next backend).
        """
        if self._supervisor_source is not None and _builds.touch(self._supervisor_source[0]):
            return self._supervisor_source[1]
        with mapped_engine_errors(self.image, self.runtime):
            image_id = str(api.inspect_image(self.image)["Id"])
        self._image_id = image_id
        folder = _guest.supervisor_dir(self.state_dir, image_id)
        if not _guest.has_bytecode(folder, image_id):
            self._compile(api, folder, image_id)
        source = self._fill_volume(api, folder, image_id) if self.remote else str(folder)
        self._supervisor_source = (folder, source)
        return source

    def _helper(
        self, api: Any, command: list[str], binds: dict[str, dict[str, str]], volumes: tuple[str, ...] = ()
    ) -> str:
        """A container that does one chore with the image, labelled like a sandbox for gc.
        ``volumes``: where it gets an anonymous volume (removed with it, ``remove_container``)."""
        host_config = api.create_host_config(
            network_mode="none",
            binds=binds,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=256 * _guest.MiB,
            pids_limit=64,
            runtime=self.runtime,
            log_config=no_logs(),
        )
        created = api.create_container(
            self.image,
            command=command,
            volumes=list(volumes) or None,
            user=f"{_guest.SANDBOX_UID}:{_guest.SANDBOX_UID}",
            network_disabled=True,
            labels=self._labels(SandboxSpec(), "helper-" + secrets.token_hex(4)),
            host_config=host_config,
        )
        return str(created["Id"])

    def _compile(self, api: Any, folder: Path, image_id: str) -> None:
        """Best effort: without bytecode, the supervisor compiles its modules at every start
        (~30 ms of each under gVisor), which a failure here logs once per backend.

        The helper writes its output to files in its own /tmp volume (``WORK``), fetched from
        the stopped container: it has no log (``no_logs``) to read them from, and under gVisor
        the engine cannot read what it wrote to its root filesystem.
        """
        to_file = (
            f"import sys\nsys.stderr = open({COMPILE_ERRORS!r}, 'w')\nsys.stdout = open({COMPILED!r}, 'w')\n"
        )
        argv = ["python3", "-S", "-E", "-s", "-c", to_file + _guest.COMPILE, f"{WORK}/stockade-src"]
        cid = ""
        try:
            with mapped_engine_errors(self.image, self.runtime):
                cid = self._helper(api, argv, {}, volumes=(WORK,))
                api.put_archive(cid, WORK, _tar(_guest.python_sources(folder), folder="stockade-src"))
                api.start(cid)
                status = api.wait(cid, timeout=START_TIMEOUT_S).get("StatusCode")
                if status != 0:
                    raise ValueError(f"its python exited with {status}: {self._compile_errors(api, cid)}")
                out = _fetch_file(api, cid, COMPILED)
            _guest.install_bytecode(folder, image_id, json.loads(out))
        except (exc.StockadeError, ValueError, KeyError, OSError, tarfile.TarError) as err:
            log.warning(
                "the supervisor's bytecode for image %s (runtime %s) was not compiled: %s; each "
                "sandbox's supervisor compiles its modules as it starts instead",
                self.image,
                self.runtime or "default",
                err,
            )
        finally:
            if cid:
                remove_container(api, cid)

    @staticmethod
    def _compile_errors(api: Any, cid: str) -> str:
        """The tail of what a failed compile wrote to its stderr, for the log."""
        unread: tuple[type[BaseException], ...] = (*engine_failures(), ValueError, tarfile.TarError)
        try:
            text = _fetch_file(api, cid, COMPILE_ERRORS).decode(errors="replace").strip()
        except unread as err:
            return f"(its errors unread: {err})"
        return text[-MAX_ERRORS:] or "(nothing on its stderr)"

    def _fill_volume(self, api: Any, folder: Path, image_id: str) -> str:
        """A volume holding the supervisor folder, for engines that cannot see this host's files.

        Named after the folder (so after its content); filled once per image, through a
        container that is created but never started (the engine writes into its volumes).
        """
        name = f"stockade-{folder.name}"
        marker = f".bytecode-{_guest.bytecode_key(image_id)}"
        cid = ""
        with mapped_engine_errors(self.image, self.runtime):
            api.create_volume(name, labels={_guest.LABEL: "supervisor"})
            try:
                cid = self._helper(api, ["true"], {name: {"bind": _guest.SUPERVISOR_MOUNT, "mode": "rw"}})
                try:
                    api.get_archive(cid, f"{_guest.SUPERVISOR_MOUNT}/{marker}")[0].close()
                    return name
                except docker_py().errors.NotFound:
                    pass
                files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
                files |= {
                    f"__pycache__/{p.name}": p.read_bytes() for p in sorted(folder.glob("__pycache__/*.pyc"))
                }
                files.pop(marker, None)
                files[marker] = b""  # last: a partly filled volume is filled again
                api.put_archive(cid, _guest.SUPERVISOR_MOUNT, _tar(files))
            finally:
                if cid:
                    remove_container(api, cid)
        return name
