"""``stockade serve`` stopped as a service manager stops it (SIGTERM) leaves nothing of its
sandboxes on the host: uvicorn closes the app, then raises the signal again, so the process
ends by it and no finalizer runs; what a tier started ahead of the next create (the microVM's
QEMU, waiting for a sandbox to come) left its folder and cgroup behind until a `stockade gc`."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from stockade.client import Client
from stockade.sandbox._guest import default_state_dir
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, write_tenants


def vms_of(pid: int) -> set[str]:
    """The microVMs (their folders' names, ``vm-sbx-...``) that process ``pid`` started."""
    found = set()
    for owner in glob.glob(str(default_state_dir() / "vm-sbx-*" / "owner.json")):
        try:
            creator = str(json.loads(Path(owner).read_text()).get("creator", ""))
        except (OSError, ValueError):
            continue  # one being made or removed
        if creator.partition(":")[0] == str(pid):
            found.add(Path(owner).parent.name)
    return found


def cgroups_named(names: set[str]) -> list[str]:
    return [p for p in glob.glob("/sys/fs/cgroup/**/vm-sbx-*", recursive=True) if Path(p).name in names]


def test_a_service_stopped_by_sigterm_leaves_no_microvm_behind(tmp_path: Path) -> None:
    require_tier("microvm")
    tenants, tokens = write_tenants(tmp_path)
    policy = tmp_path / "policy.toml"  # the tenants' policy, with the microVM allowed
    policy.write_text(policy.read_text().replace('dev]\ntiers = ["process"]', 'dev]\ntiers = ["microvm"]'))
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        with Client(server.url, tokens.acme) as client:
            sbx = client.sandbox("microvm")  # the tier then starts the next QEMU ahead
            assert sbx.run_code("print(1)").logs.stdout == "1\n"
            wait_for(lambda: len(vms_of(server.pid)) >= 2, what="a QEMU started ahead", timeout_s=60)
            started = vms_of(server.pid)
        server.proc.terminate()
        assert server.proc.wait(60) != 0  # ended by the signal, after the app closed
    finally:
        server.stop()
    left = [name for name in started if (default_state_dir() / name).exists()]
    assert not left and not cgroups_named(started), (left, cgroups_named(started), server.output()[-1500:])
