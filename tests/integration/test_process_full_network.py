"""The process tier's whole network is walled like docker's: a network namespace of the
sandbox's own, whose way out is slirp4netns, run as the sandbox's host uid and refused by the
host's firewall whatever is not public (stockade.sandbox._slirp, _netfull.ensure_uid_rules).

Refusals must come at once (a reset, or unreachable), never after a probe's timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import LimitNotEnforceable, NetworkPolicy, Sandbox, SandboxCrashed
from stockade.sandbox.process import ProcessBackend
from stockade.types import Mechanism
from tests.conftest import processes_of_uid, require, require_tier
from tests.integration.network_probes import host_address, listening, probe

WHOLE = NetworkPolicy(enabled=True)


@pytest.fixture(autouse=True)
def _walls() -> None:
    require_tier("process")
    require("root", os.geteuid() == 0, "the walls are a firewall for the sandbox's own host uid")
    require("slirp4netns", shutil.which("slirp4netns") is not None, "apt-get install slirp4netns")


@pytest.fixture
def host_listeners() -> Iterator[tuple[int, int]]:
    """Listeners of this host: one on its loopback, one on every address (their ports)."""
    with socket.create_server(("127.0.0.1", 0)) as loop, socket.create_server(("0.0.0.0", 0)) as every:
        yield loop.getsockname()[1], every.getsockname()[1]


def test_the_whole_network_is_walled_without_consent(host_listeners: tuple[int, int]) -> None:
    loopback, every = host_listeners
    targets = [f"127.0.0.1:{loopback}", f"127.0.0.1:{every}", f"10.0.2.2:{every}"]  # 10.0.2.2: slirp's host
    targets += [f"{address}:{every}" for address in [host_address()] if address]
    with Sandbox.create("process", network=WHOLE) as sbx:
        assert sbx.enforcement.network is Mechanism.FIREWALL and not sbx.enforcement.weakened
        found = probe(sbx, *targets)
    assert set(found.values()) <= {"ConnectionRefusedError", "OSError"}, found  # OSError: unreachable


def test_private_and_metadata_addresses_fail_fast() -> None:
    targets = ["169.254.169.254:80", "10.1.2.3:80", "192.168.77.1:443", "100.64.0.1:80", "172.31.0.9:22"]
    with Sandbox.create("process", network=WHOLE) as sbx:
        # Refused, not timed out (a drop would raise TimeoutError after the probe's 10 s).
        assert probe(sbx, *targets) == dict.fromkeys(targets, "ConnectionRefusedError")


def test_the_hosts_abstract_sockets_are_neither_listed_nor_reachable() -> None:
    name = f"stockade-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as host_side:
        host_side.bind(f"\0{name}")
        host_side.listen()
        assert f"@{name}" in Path("/proc/net/unix").read_text()
        with Sandbox.create("process", network=WHOLE) as sbx:
            assert f"@{name}" not in sbx.commands.run("cat /proc/net/unix").stdout
            code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect('\\0{name}')"
            assert "ConnectionRefusedError" in sbx.commands.run(["python3", "-c", code]).stderr


def test_names_resolve_through_the_hosts_resolvers() -> None:
    """slirp4netns's resolver (10.0.2.3) asks the host's, which the walls let through on port 53."""
    host = subprocess.run(["getent", "ahostsv4", "pypi.org"], capture_output=True, text=True, check=False)
    require("a resolver", host.returncode == 0, "this host resolves no pypi.org")
    with Sandbox.create("process", network=WHOLE) as sbx:
        assert sbx.commands.run("cat /etc/resolv.conf").stdout == "nameserver 10.0.2.3\n"
        found = sbx.commands.run("getent ahostsv4 pypi.org")
    assert found.exit_code == 0 and found.stdout.split()[0] == host.stdout.split()[0]


def test_two_sandboxes_cannot_reach_each_other() -> None:
    with Sandbox.create("process", network=WHOLE) as a, Sandbox.create("process", network=WHOLE) as b:
        with listening(a) as served:
            # Each has the same address (slirp's 10.0.2.100): B's own, not A's; and via the host, walled.
            assert probe(b, "10.0.2.100:8099", "10.0.2.2:8099") == {
                "10.0.2.100:8099": "ConnectionRefusedError",
                "10.0.2.2:8099": "OSError",
            }
        assert served == ["listening\naccepted\n"]


def test_nothing_is_left_after_close_or_a_crash() -> None:
    """slirp4netns runs as the sandbox's uid: none of that uid's processes outlives it."""
    for crash in (False, True):
        sbx = Sandbox.create("process", network=WHOLE)
        uid = os.stat(Path("/run/stockade") / sbx.id).st_uid
        names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in processes_of_uid(uid)}
        assert "slirp4netns" in names.values(), names
        if crash:  # everything of the sandbox's but slirp4netns killed from outside
            for pid, name in names.items():
                if name != "slirp4netns":
                    os.kill(pid, signal.SIGKILL)
            with pytest.raises(SandboxCrashed):
                sbx.commands.run("true")
        sbx.close()
        assert processes_of_uid(uid) == []


def test_a_pinned_host_uid_cannot_be_walled_and_needs_consent() -> None:
    """The walls name the leased uids: a backend whose sandboxes share one uid keeps today's
    host stack, refused unless allow_weaker, and says why."""
    pinned = ProcessBackend(host_uid=65534)
    with pytest.raises(LimitNotEnforceable, match="host_uid") as refused:
        Sandbox.create(backend=pinned, network=WHOLE)
    assert "allow_weaker" in refused.value.fix
