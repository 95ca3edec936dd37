"""What a sandbox sees of its host: nothing that names or fingerprints it.

Compared from the host: its kernel command line, its boot id, the container's id on the
container tiers. What stays visible, and why, is listed in docs/architecture.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stockade import Limits, Sandbox
from stockade.sandbox._hostinfo import PROC_FILES, SYS_DIRS
from tests.integration.test_containment import engine_container

READ = 16 * 1024  # of each file: enough to recognise it
# Everywhere the host's names were found, and the masked files.
PLACES = (
    "/proc/self/mountinfo",
    "/proc/self/mounts",
    "/proc/self/cgroup",
    "/proc/1/cgroup",
    "/proc/1/mountinfo",
    "/proc/self/environ",
    "/etc/hostname",
    "/etc/hosts",
    "/proc/sys/kernel/hostname",
    *PROC_FILES,
)

READ_INSIDE = """
import json, os, socket
seen = {"uname": " ".join(os.uname()), "hostname": socket.gethostname()}
for path in PLACES:
    try:
        with open(path, "rb") as fh:
            seen[path] = fh.read(READ).decode("latin-1")
    except OSError as e:
        seen[path] = None
for path in SYS_DIRS:
    try:
        seen[path] = sorted(os.listdir(path))
    except OSError:
        seen[path] = None
print(json.dumps(seen))
"""


def _inside(sbx: Sandbox) -> dict[str, object]:
    code = f"PLACES = {list(PLACES)!r}\nSYS_DIRS = {list(SYS_DIRS)!r}\nREAD = {READ}\n" + READ_INSIDE
    ex = sbx.run_code(code)
    assert ex.error is None and not ex.truncated, ex.error
    seen = json.loads(ex.logs.stdout)
    assert isinstance(seen, dict)
    return seen


def _host_names(sbx: Sandbox) -> dict[str, str]:
    names = {
        "the host's kernel command line": Path("/proc/cmdline").read_text().strip(),
        "the host's boot id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
    }
    if sbx.tier in ("docker", "gvisor"):
        info = engine_container(sbx)
        if info is not None:
            names["the container's id"] = info["Id"][:12]  # the short form is in the long one
    return names


def test_nothing_inside_names_the_host(tier: str) -> None:
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30)) as sbx:
        seen = _inside(sbx)
        names = _host_names(sbx)
    for place, content in seen.items():
        for what, name in names.items():
            assert name not in json.dumps(content), f"{place} shows {what}"


def test_the_hosts_kernel_files_are_masked(tier: str) -> None:
    # Where the kernel is the host's (process, docker), its files read empty; gVisor and the
    # microVM show their own kernel's, never the host's.
    with Sandbox.create(tier, limits=Limits(memory_mb=256, timeout_s=30)) as sbx:
        seen = _inside(sbx)
    for path in PROC_FILES:
        try:
            with open(path, "rb") as fh:
                host = fh.read(READ).decode("latin-1")
        except OSError:
            continue
        inside = seen[path]
        assert not inside or inside != host, f"{path} is the host's"
    for path in SYS_DIRS:
        assert not seen[path], f"{path} lists {seen[path]}"
    assert str(seen["hostname"]) == "sandbox" and " sandbox " in str(seen["uname"])


def test_what_programs_read_in_proc_stays(sbx: Sandbox) -> None:
    r = sbx.commands.run(
        "nproc && head -1 /proc/meminfo && head -1 /proc/stat && cat /proc/uptime /proc/loadavg >/dev/null"
        " && python3 -c 'import os; print(os.cpu_count() > 0)'"
        " && for tool in ps free uptime; do ! command -v $tool >/dev/null || $tool >/dev/null || exit 1; done"
    )
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert int(lines[0]) >= 1 and lines[1].startswith("MemTotal:") and lines[2].startswith("cpu ")
    assert lines[3] == "True"


@pytest.mark.parametrize("path", ["/proc/cmdline", "/proc/sys/kernel/random/boot_id"])
def test_masked_files_cannot_be_written_through(sbx: Sandbox, path: str) -> None:
    sbx.commands.run(f"echo planted > {path}")
    assert "planted" not in sbx.commands.run(f"cat {path}").stdout
