"""Starting ``runsc run`` (or ``restore``) on a bundle stockade writes, and undoing it.

A part of ``RunscBackend`` (``gvisor.py``), on ``RunscSettings``: the bundle's folder claimed,
its tmpfs mounted (a restore's files unpacked in them), the egress proxy, ``config.json``
(the offline rootfs, or a container's image and mounts for the restore of a Docker
checkpoint), runsc started with stdio to the supervisor, and all of it let go when the start
fails. What the bundle holds on the host and how it is released is ``_gvisor_bundle``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from stockade import _exit
from stockade import exceptions as exc
from stockade.sandbox import (
    _guest,
    _gvisor_areas,
    _gvisor_docker_memory,
    _gvisor_memory,
    _host,
    _rules,
    _trusted,
)
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox._gvisor_bundle import (
    RunscBoundary,
    hold_memory_group,
    keep_head,
    preload_supervisor,
    release,
)
from stockade.sandbox._gvisor_memory import RunscInstance
from stockade.sandbox._gvisor_settings import CGROUP_PARENT, RunscSettings
from stockade.sandbox._host import PipeStream
from stockade.sandbox._supervised_config import WORKSPACE
from stockade.sandbox.base import SandboxSpec
from stockade.types import Enforcement


class RunscLaunch(RunscSettings):
    """The part of ``RunscBackend`` that starts runsc on a bundle."""

    def _undo_launch(
        self,
        sid: str,
        proc: subprocess.Popen[bytes] | None,
        bundle: Path,
        mounts: list[Path],
        egress: EgressHandle | None,
    ) -> None:
        """What a launch that failed holds, let go; may run twice (again at exit)."""
        if proc is not None:  # runsc was started: its sandbox may be running
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            self.destroy(sid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        release(bundle, mounts, egress)

    def _launch(
        self,
        spec: SandboxSpec,
        sid: str,
        enforcement: Enforcement,
        *,
        masks: tuple[str, ...],
        command: tuple[str, ...],
        files: dict[str, Path] | None = None,
        docker: _gvisor_docker_memory.DockerLayout | None = None,
    ) -> RunscInstance:
        """Write the bundle (tmpfs, with ``files`` unpacked in them; the egress proxy;
        config.json) and start ``runsc run`` or ``restore`` on it, stdio to the supervisor.
        ``docker``: the restore of a container's image, on its image's root and its mounts."""
        if not self._collected:
            self._collected = True
            from stockade.sandbox.gvisor import collect_garbage  # it makes a RunscBackend

            collect_garbage()
        if docker is not None:
            folder = _guest.supervisor_dir(self.state_dir, docker.image)
        else:
            assert self.rootfs is not None
            _trusted.check(self.rootfs)  # its python compiles the supervisor, chrooted, as us
            folder = _guest.supervisor_dir(self.state_dir, str(self.rootfs))
            if not _guest.has_bytecode(folder, str(self.rootfs)) and not self._compile_failed:
                self._compile(folder)
        uid = docker.uid if docker is not None else _guest.SANDBOX_UID
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        bundle = self.state_dir / f"gv-{sid}"
        # The host side of the sandbox's files, nobody else's to see (0700), held until
        # released: gc spares it before its config.json says who created it (a restore's
        # memory unpacked into its tmpfs first can take a while).
        _host.claim_folder(bundle)
        mounts: list[Path] = []
        proc: subprocess.Popen[bytes] | None = None
        egress = None
        try:
            binds: dict[str, Path] = {}
            # noexec on the host too, as under Docker: gVisor's kernel does not refuse an
            # executable mapping of a noexec mount's file (a library in LD_PRELOAD, dlopen),
            # the host kernel refuses it under gVisor's own mapping, and that code faults.
            noexec = _rules.written_noexec(spec)
            for target, (size, inodes, mode) in _guest.tmpfs_sizes(spec).items():
                path = bundle / _guest.host_folder(target)
                path.mkdir()
                mounts.append(path)  # before the mount: one cut short is undone too
                _guest.mount_tmpfs(path, size=size, inodes=inodes, mode=mode, uid=uid, noexec=noexec)
                binds[target] = path
                if files is not None:
                    _gvisor_areas.unpack_area(
                        files[path.name], path, max_bytes=size, max_entries=inodes, uid=uid
                    )
            if spec.network.egress:  # in the bundle (root's, 0700): only the sandbox reaches it
                from stockade.egress import attach

                egress = attach(spec, bundle / "egress", root=self.rootfs, shared=True, preload=True)
                binds[_guest.EGRESS_DIR] = egress.folder
            # a container's image restores on the image's own files; others on the offline rootfs
            root = self.rootfs
            if docker is not None:
                root = _gvisor_docker_memory.image_root(docker.image, bundle / "rootfs", mounts)
            assert root is not None
            annotations = {
                _guest.LABEL: "1",
                _guest.LABEL_ID: sid,
                _guest.LABEL_CREATOR: self.creator.token,
                _guest.LABEL_HOST: self.creator.host,
            }
            config = _guest.oci_config(
                spec,
                rootfs=root,
                folder=folder,
                binds=binds,
                cgroup=f"/{CGROUP_PARENT}/{sid}",
                host=_guest.own_kernel_limits(spec, self.platform),
                annotations=annotations,
                mask_binds=_guest.mask_binds(masks, root=root, state_dir=self.state_dir, rundir=bundle)
                if docker is None
                else (),
            )
            preload_supervisor(config, egress)
            if docker is not None:
                config["process"]["user"] = {"uid": uid, "gid": uid, "additionalGids": [uid]}
                config["mounts"] = docker.oci_mounts(self._docker_sources(bundle, binds, folder, uid))
            (bundle / "config.json").write_text(json.dumps(config))
            hold_memory_group(sid, _guest.own_kernel_limits(spec, self.platform).host_memory)
            # The host descriptors its kernel and gofer may hold: set here, not inherited
            # from whoever runs stockade (a service's LimitNOFILE would be the bound).
            fdlimit = _guest.gvisor_fd_limit(spec.limits)
            fd_flags = (f"--fdlimit={fdlimit}", f"--dcache={_guest.GVISOR_DCACHE}")
            proc = subprocess.Popen(
                self._argv(*fd_flags, *command, "--bundle", str(bundle), sid, egress=egress is not None),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin"},
                close_fds=True,
                start_new_session=True,
            )
            keep_head(proc, bundle / "runsc.log")
        except BaseException as err:  # an interrupt (a Ctrl-C) too; once more at exit if cut short again
            _exit.undo(self._undo_launch, sid, proc, bundle, mounts, egress)
            if isinstance(err, OSError):
                raise exc.SandboxStartError(f"cannot start runsc: {err}") from err
            raise
        boundary = RunscBoundary(self, sid, proc, bundle, mounts)
        boundary.egress = egress
        stream = PipeStream(proc)
        instance = RunscInstance(
            id=sid,
            tier=self.tier,
            stream=stream,
            boundary=boundary,
            spec=spec,
            enforcement=enforcement,
        )
        instance.backend = self
        instance.bundle = bundle
        instance.egress = egress
        instance.docker = docker
        if docker is not None:
            instance.machine_key = _gvisor_docker_memory.docker_machine_key(
                self.runsc, self.platform, docker.image, folder, masks
            )
        else:
            instance.machine_key = _gvisor_memory.machine_key(self, folder, masks)
        _exit.finalize(instance, _guest.abandon, stream, boundary)
        return instance

    def _docker_sources(
        self, bundle: Path, binds: dict[str, Path], folder: Path, uid: int
    ) -> dict[str, Path]:
        """What each role of a container's binds is in this bundle (its accounts name ``uid``)."""
        etc = bundle / "etc"
        etc.mkdir(mode=0o755)
        for name, text in _guest.etc_files(uid).items():
            (etc / name).write_text(text)
            os.chmod(etc / name, 0o644)
        return {
            "workspace": binds[WORKSPACE],
            "tmp": binds["/tmp"],
            "shm": binds[_guest.SHM],
            "supervisor": folder,
            "passwd": etc / "passwd",
            "group": etc / "group",
            "null": Path("/dev/null"),
            "unreadable": _guest.unreadable_file(self.state_dir),
        }
