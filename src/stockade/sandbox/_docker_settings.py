"""What a Docker backend is made with, and what it asks the engine about its runtime.

The base of ``DockerBackend``: its settings (image, runtime, engine, state folder, creator),
the engine's client, made once, and the engine's entry for the runtime (gVisor's platform
and cache, its ``runtimeArgs``), read once. The labels every container of stockade carries
(for ``collect_garbage``) name this backend's creator. Planning (``_docker_plan``) and the
supervisor's files (``_docker_supervisor``) build on it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _guest
from stockade.sandbox._docker_engine import engine_client, engine_failures, is_remote, mapped_engine_errors
from stockade.sandbox.base import Backend, SandboxSpec

DEFAULT_IMAGE = "stockade-sandbox:latest"
START_TIMEOUT_S = 30.0
API_TIMEOUT_S = 30.0


class DockerSettings(Backend):
    """A Docker backend's settings and engine; ``DockerBackend`` says what they mean."""

    def __init__(
        self,
        *,
        image: str | None = None,
        runtime: str | None = None,
        base_url: str | None = None,
        tier: str = "docker",
        own_kernel: bool = False,
        state_dir: Path | None = None,
        remote: bool | None = None,
    ) -> None:
        self.image = image or os.environ.get("STOCKADE_IMAGE") or DEFAULT_IMAGE
        self.runtime = runtime
        self.base_url = base_url
        self.tier = tier
        self.own_kernel = own_kernel
        self.remote = is_remote(base_url) if remote is None else remote
        self.host_tmpfs = own_kernel and os.geteuid() == 0 and not self.remote
        self.state_dir = state_dir or _guest.default_state_dir()
        self.creator = _guest.current_creator()
        self._api_client: Any = None
        self._lock = threading.Lock()
        self._collected = False
        self._supervisor_source: tuple[Path, str] | None = None
        self._platform: str | None = None
        self._runtime: dict[str, Any] | None = None
        self._image_id: str | None = None

    def _runtime_entry(self) -> dict[str, Any]:
        """The engine's entry for this runtime: its binary (``path``) and ``runtimeArgs``."""
        if self._runtime is None:
            entry: dict[str, Any] = {}
            unknown: tuple[type[BaseException], ...] = (exc.StockadeError, KeyError, *engine_failures())
            with contextlib.suppress(*unknown):
                entry = dict((self._api().info().get("Runtimes") or {}).get(self.runtime or "") or {})
            self._runtime = entry
        return self._runtime

    def _runtime_platform(self) -> str:
        """The gVisor platform the engine runs this runtime with (its ``--platform`` argument)."""
        if self._platform is None:
            platform = "systrap"  # runsc's own default
            entry = self._runtime_entry()
            for arg in entry.get("runtimeArgs") or entry.get("runtimeargs") or []:
                if str(arg).startswith("--platform="):
                    platform = str(arg).split("=", 1)[1]
            self._platform = platform
        return self._platform

    def _runtime_dcache(self) -> int | None:
        """The runtime's ``--dcache`` (gVisor's cache of closed files), None if it has none."""
        entry = self._runtime_entry()
        for arg in entry.get("runtimeArgs") or entry.get("runtimeargs") or []:
            name, _, value = str(arg).partition("=")
            if name == "--dcache" and value.isdigit():
                return int(value)
        return None

    def _api(self) -> Any:
        with self._lock:
            if self._api_client is None:
                with mapped_engine_errors(self.image, self.runtime):
                    self._api_client = engine_client(self.base_url, API_TIMEOUT_S)
            return self._api_client

    def _runtime_args(self, wanted: tuple[str, ...]) -> bool:
        unknown: tuple[type[BaseException], ...] = (exc.StockadeError, KeyError, *engine_failures())
        try:
            entry = (self._api().info().get("Runtimes") or {}).get(self.runtime or "") or {}
        except unknown:
            return False
        args = entry.get("runtimeArgs") or entry.get("runtimeargs") or []
        return any(str(arg) in wanted for arg in args)

    def _labels(self, spec: SandboxSpec, sid: str) -> dict[str, str]:
        return {
            **{str(k): str(v) for k, v in spec.labels.items()},
            _guest.LABEL: "1",
            _guest.LABEL_ID: sid,
            _guest.LABEL_PID: str(self.creator.pid),
            _guest.LABEL_CREATOR: self.creator.token,
            _guest.LABEL_HOST: self.creator.host,
        }
