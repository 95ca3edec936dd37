"""How bwrap runs a sandbox's supervisor: its files ready, its options, its process entered.

A part of ``ProcessBackend``: the shared read-only folder made ready (once, and again when the
host's /etc changes or the judge is asked for), this backend's bwrap options, and the
supervisor started either by bwrap exec'ing a fresh Python or as a fork of the warm template,
in both cases entered into the sandbox's cgroups as its host uid (the launcher, else sh and
nsenter). ``start`` in ``process.py`` sets the sandbox up around it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from stockade import _exit
from stockade.sandbox import _builds, _cgroups, _launch, _template, _trusted
from stockade.sandbox._lasting import spawn
from stockade.sandbox._process_bwrap import (
    GROUP,
    HOSTS,
    PASSWD,
    build_shared,
    bwrap_options,
    find_host_etc,
    memfd,
    supervisor_command,
)
from stockade.sandbox._process_rundirs import collect_garbage
from stockade.sandbox._process_settings import ProcessSettings
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.supervisor import sources as supervisor_sources


class ProcessSpawn(ProcessSettings):
    """The part of ``ProcessBackend`` that runs bwrap."""

    def _prepare(self, judge: bool = False) -> None:
        """The read-only files every sandbox binds (supervisor, /etc), once per process and
        again when a file the folder copies from the host's /etc has changed.

        ``judge``: the sandbox has rules, and the folder must ship the compiled exec judge
        where the host can build it. A sandbox without them never waits for the compiler
        (about a second, once per host), and ships the judge only if it was built already.

        The folder is named after a hash of its content, so every process of this host
        shares one copy and a stale copy is never mistaken for the current one.
        """
        host_etc = find_host_etc(self.rootfs or Path("/"))
        if (
            self._prepared
            and host_etc == self._host_etc
            and (self._judge_asked or not judge)
            and _trusted.check(self._shared / "complete").exists()  # no other user's since (~15 us)
            and _builds.touch(self._shared)  # used: gc keeps it
        ):
            return
        if not self._prepared:  # once per process: a host /etc file changing needs no collection
            collect_garbage(self.state_dir)
            self._launcher = _launch.usable() if self.use_launcher else None
        # Another user's folder (a /tmp/stockade-<uid> made before ours) is refused, typed.
        state_dir = _trusted.folder(self.state_dir, 0o711)
        if state_dir.stat().st_uid == os.geteuid():  # root's, to a user: theirs to mode
            os.chmod(state_dir, 0o711)
        self._judge_asked = self._judge_asked or judge
        sources = supervisor_sources(judge=self._judge_asked)
        etc_files = {
            "passwd": PASSWD,
            "group": GROUP,
            "hosts": HOSTS,
            "hostname": "sandbox\n",
            "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
            "resolv.conf": "",
        }
        digest = hashlib.sha256(
            repr(
                (sorted(sources.items()), sorted(etc_files.items()), host_etc, self.python, str(self.rootfs))
            ).encode()
        ).hexdigest()[:16]
        shared = self.state_dir / f"shared-{digest}"
        if not (shared / "complete").exists():
            build_shared(
                shared,
                sources,
                etc_files,
                host_etc,
                state_dir=self.state_dir,
                python=self.python,
                rootfs=self.rootfs,
            )
        _builds.touch(shared)
        self._shared = shared
        self._host_etc = host_etc
        self._prepared = True

    def _bwrap_options(
        self,
        spec: SandboxSpec,
        rundir: Path,
        seccomp_fd: int,
        masks: tuple[str, ...] = (),
        joined: tuple[int, int] | None = None,
    ) -> list[str]:
        """This backend's sandbox's bwrap options (``_process_bwrap.bwrap_options``)."""
        return bwrap_options(
            spec,
            rundir,
            seccomp_fd,
            masks,
            joined,
            root=self.rootfs or Path("/"),
            shared=self._shared,
            host_etc=self._host_etc,
            is_root=self.is_root,
            share_net=self._host_net(spec),
            state_dir=self.state_dir,
        )

    def _template_for(self, uid: int | None) -> _template.Template | None:
        """The template, where this sandbox starts from it: asked for, as root, on the host's
        root, with a bwrap that can join namespaces. One per folder of the supervisor's files
        (a new folder, after the judge was built, gets a new template)."""
        if self.start_mode != "template" or self.rootfs is not None or not self.is_root or uid is None:
            return None
        if not _template.supported(self.bwrap):
            return None
        folder = self._shared / "supervisor"
        if self._template is None or self._template.shared != folder:
            if self._template is not None:
                self._template.close()
            self._template = _template.Template(self.python, folder)
            _exit.finalize(self, self._template.close)  # ends with this backend, or at exit
        return self._template

    def _exec(
        self,
        spec: SandboxSpec,
        rundir: Path,
        *,
        seccomp_fd: int,
        masks: tuple[str, ...],
        uid: int | None,
        cgroup: _cgroups.Cgroup | None,
        fds: list[int],
    ) -> subprocess.Popen[bytes]:
        """bwrap, which execs a fresh Python for the supervisor as the sandbox's pid 1."""
        options = b"".join(o.encode() + b"\0" for o in self._bwrap_options(spec, rundir, seccomp_fd, masks))
        options_fd = memfd("stockade-bwrap", options)
        fds.append(options_fd)  # closed by the caller
        argv = [self.bwrap, "--args", str(options_fd), *supervisor_command(self.python)]
        # bwrap.log, bwrap's and the supervisor's stderr, has no cap on the host's disk: code
        # cannot write to it. Its commands and interpreters get pipes of their own on fd 2; the
        # supervisor and its zygote, which keep this one, are non-dumpable (their /proc fds
        # are closed to code of their uid). Only bwrap and the supervisor's own Python (a
        # traceback as it dies) write here; the process tier's tests check that code cannot.
        # forked by the thread that lives as long as we do (--die-with-parent is the forking
        # thread's death): a sandbox outlives the caller's thread that started it
        entering = self._entering(argv, uid, cgroup)
        with open(rundir / "bwrap.log", "wb") as stderr:
            return spawn(
                lambda: subprocess.Popen(
                    entering,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env={},
                    close_fds=True,
                    pass_fds=tuple(fds),
                )
            )

    def _entering(self, argv: list[str], uid: int | None, cgroup: _cgroups.Cgroup | None) -> list[str]:
        """``argv`` started inside the sandbox's cgroups, as its host uid: in the exec chain,
        not with Popen(user=...), which would rule out vfork and copy this whole process for
        every sandbox. The launcher does both in one exec; else sh, then nsenter."""
        drop = uid if uid is not None and self.is_root else None
        if self._launcher is not None and (drop is not None or cgroup is not None):
            join = cgroup.join_files() if cgroup is not None else []
            return _launch.chain(self._launcher, drop, join, argv)
        if drop is not None:
            argv = [self.nsenter, "-S", str(drop), "-G", str(drop), "--", *argv]
        if cgroup is not None:
            argv = cgroup.entering(argv)
        return argv
