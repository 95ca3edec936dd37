"""What a tier works out before its supervisor runs: the sandbox's id and the ``init`` frame
(the environment, caps, default timeout, the egress relay and the descriptors it needs).

Apart from the instance: a tier sizes its boundary by these (the workspace's path, the
relay's descriptors) before anything starts, and the facades name the workspace without a
sandbox at all.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any

from stockade import exceptions as exc
from stockade.egress.proxy import MAX_CONNECTIONS
from stockade.sandbox._boundary import EgressHandle
from stockade.sandbox.base import SandboxSpec
from stockade.types import Limits

WORKSPACE = "/workspace"
# The supervisor's egress relay carries as many connections at once as the host's proxy
# serves, two descriptors each (supervisor/egress.py): a package manager's burst fits.
RELAY_FILES = 2 * MAX_CONNECTIONS
_SANDBOX_ID = re.compile(r"^sbx-[0-9a-f]{12}$")

__all__ = ["RELAY_FILES", "WORKSPACE", "sandbox_id", "supervisor_config", "supervisor_files"]


def supervisor_config(
    spec: SandboxSpec, rlimits: dict[str, int] | None = None, egress: EgressHandle | None = None,
    *, seal: bool = False, refuse_kernel: bool = False, host_network: bool = False,
    refuse_filters: bool = False, refuse_memfds: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The ``init`` frame every tier sends: the environment, caps and default timeout; with
    ``egress`` (a ``stockade.egress.Attachment``), the proxy's variables and the relay.
    ``seal``: code in the sandbox can open the supervisor's pipes (gVisor's ``/proc``), so
    every frame after ``ready`` is sealed (``protocol.Seal``). ``refuse_kernel``: a tier whose
    own filter does not refuse it (a container engine's profile) has the supervisor refuse
    what takes host memory or a host-wide quota uncharged (``_seccomp``'s list: AIO contexts,
    netlink, UDP where the loopback is the only network). ``host_network``: the sandbox
    shares the host's network namespace, whose sockets are not the sandbox's to account for
    at a reset. ``refuse_filters``: the code's kernel is the host's, where each seccomp filter
    is JIT code no cgroup charges, counted against the host's shared ``bpf_jit_limit``: once
    its own filters are in place, the supervisor lets no process add one
    (``callfilters.refuse_filters``). ``refuse_memfds``: no exec listener refuses memfds where a
    written program must not run (gVisor's kernel has none): the supervisor's own filter does
    (``callfilters.deny_calls``)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "TMPDIR": "/tmp",
        "MPLBACKEND": "Agg",
    }
    # Numeric libraries start a thread per core they see (the host's, on most tiers): on a
    # large host that is more threads than the sandbox's pids allow. One per CPU it was given.
    threads = str(max(1, math.ceil(spec.limits.cpus)))
    env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if rlimits is not None and "RLIMIT_AS" in rlimits:
        # Under a per-process address-space limit glibc's arena per thread (64 MiB reserved)
        # left a process about a dozen threads whatever memory_mb: one arena, and a thread
        # costs its stack (8 MiB), so memory_mb / 8 MiB of them, less what the process maps.
        env["MALLOC_ARENA_MAX"] = "1"
    if egress is not None:
        env.update(egress.env)
    env.update(spec.envs)
    config: dict[str, Any] = {
        "env": env,
        "workspace": WORKSPACE,
        "output_cap": spec.limits.output_bytes,
        "timeout": spec.limits.timeout_s,
        # Descriptors per process, so that the sandbox's processes hold open_files in all.
        "rlimits": {"RLIMIT_NOFILE": spec.limits.files_per_process, **(rlimits or {})},
        # The supervisor's own (supervisor.own_files): the code's and its relay's besides.
        "files": supervisor_files(spec.limits),
    }
    if egress is not None:
        config["egress"] = dict(egress.relay)
    if seal:
        config["seal"] = True
    if host_network:
        config["own_network"] = False
    if refuse_filters:
        config["no_filters"] = True
    if refuse_memfds:
        config["no_memfd"] = True
    if refuse_kernel:
        config["kernel"] = {"datagrams": not spec.network.unrestricted}
    if spec.rules is not None and spec.rules.judges_paths:
        config["links"] = False  # files calls are judged by the path they name: no link followed
    return config


def supervisor_files(limits: Limits) -> int:
    """RLIMIT_NOFILE of the supervisor: a process's of the code (``files_per_process``) and
    ``RELAY_FILES`` besides, for its egress relay's connections. What it starts has the
    code's (the tiers give the sandbox this much; the supervisor lowers it for the code)."""
    return limits.files_per_process + RELAY_FILES


def sandbox_id(spec: SandboxSpec) -> str:
    """The id of a sandbox being started: the spec's (a paused one resumes under its own),
    else a new one. It names host folders and cgroups: only ``sbx-`` and 12 hex digits."""
    if spec.sandbox_id is None:
        return "sbx-" + secrets.token_hex(6)
    if not _SANDBOX_ID.match(spec.sandbox_id):
        raise exc.InvalidArgument(f"{spec.sandbox_id!r} is no sandbox id", argument="sandbox_id")
    return spec.sandbox_id
