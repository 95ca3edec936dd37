"""The full network's firewall rules (stockade.sandbox._netfull) are taken away only on this
host's engine's word that no sandbox is on the network, and come back for a process whose
rules another took away.

Each test runs in a network namespace of its own (``unshare -n``): its rules are not the
host's, which live sandboxes of other processes stand behind. The engine is a fake, or none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import require


@pytest.fixture(autouse=True)
def _own_netns_tools() -> None:
    require(
        "a network namespace of its own",
        os.geteuid() == 0 and all(shutil.which(tool) for tool in ("unshare", "iptables", "ip")),
        "needs root, unshare, iptables and ip",
    )


# Run first in each namespace: Docker's chain, as dockerd makes it, the rules written as a
# full-network sandbox's start writes them, and an engine that answers with `networks`.
PRELUDE = """\
import json, subprocess, sys
import docker
from stockade import exceptions as exc
from stockade.sandbox import _netfull

subprocess.run(["iptables", "-N", "DOCKER-USER"], check=True)
_netfull.ensure_rules()

def rules():
    listed = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if "STOCKADE" in line]

class Engine:
    def __init__(self, *networks):
        self.networks = set(networks)
    def inspect_network(self, name):
        if name not in self.networks:
            raise docker.errors.NotFound(name)
        return {"Name": name}
    def remove_network(self, name):
        self.networks.remove(name)
"""


def in_own_netns(code: str, *, env: dict[str, str] | None = None) -> dict[str, object]:
    """What ``code`` (after the prelude) printed as JSON, run in a network namespace of its own."""
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", PRELUDE + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_gc_network_without_an_engine_refuses_and_keeps_the_walls() -> None:
    """No engine to say no sandbox is on the network (dockerd restarting with live-restore,
    DOCKER_HOST naming a socket with none behind it): exit 2, said why, every rule kept."""
    found = in_own_netns(
        """
before = rules()
gc = subprocess.run(
    [sys.executable, "-m", "stockade.cli.main", "gc", "--network"], capture_output=True, text=True
)
print(json.dumps({"code": gc.returncode, "said": gc.stderr, "kept": rules() == before, "rules": len(before)}))
""",
        env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"},
    )
    assert found["code"] == 2 and "engine" in str(found["said"]).lower()
    assert found["kept"] is True and isinstance(found["rules"], int) and found["rules"] > 10


def test_a_bridge_still_here_keeps_the_rules() -> None:
    """An engine without the network (DOCKER_HOST naming a second local daemon) while the
    bridge is on this host: the sandboxes on it keep their walls, and the refusal says why."""
    found = in_own_netns(
        """
subprocess.run(["ip", "link", "add", _netfull.BRIDGE, "type", "bridge"], check=True)
before = rules()
try:
    _netfull.remove(Engine(), remote=False)
    said = None
except exc.ConfigurationError as err:
    said = str(err)
print(json.dumps({"said": said, "kept": rules() == before}))
"""
    )
    assert found["said"] is not None and "bridge stockade0 is still on this host" in str(found["said"])
    assert found["kept"] is True


def test_the_rules_go_once_the_engine_removed_the_network() -> None:
    found = in_own_netns(
        """
engine = Engine(_netfull.NETWORK)
removed = _netfull.remove(engine, remote=False)
print(json.dumps({"removed": removed, "networks": sorted(engine.networks), "rules": rules()}))
"""
    )
    assert found["networks"] == [] and found["rules"] == []
    assert isinstance(found["removed"], list) and found["removed"][0] == "network stockade-net"
    assert "iptables chain STOCKADE-FWD" in found["removed"]


def test_a_remote_engine_has_its_network_removed_and_this_hosts_rules_kept() -> None:
    """Another host's engine says nothing of the sandboxes behind this host's rules."""
    found = in_own_netns(
        """
before = rules()
removed = _netfull.remove(Engine(_netfull.NETWORK), remote=True)
print(json.dumps({"removed": removed, "kept": rules() == before}))
"""
    )
    assert found == {"removed": ["network stockade-net"], "kept": True}


def test_rules_another_process_took_away_are_written_again() -> None:
    """A long-lived process (a service) wrote the rules; another's `stockade gc --network`
    took jumps and chains away: its next full-network sandbox writes them again."""
    found = in_own_netns(
        """
first = rules()
for tool, chains in (("iptables", ("DOCKER-USER", "INPUT")), ("ip6tables", ("FORWARD", "INPUT"))):
    for chain, target in zip(chains, ("STOCKADE-FWD", "STOCKADE-IN")):
        subprocess.run([tool, "-D", chain, "-i", "stockade0", "-j", target], check=True)
    for target in ("STOCKADE-FWD", "STOCKADE-IN", "STOCKADE-REJECT"):
        subprocess.run([tool, "-F", target], check=True)
        subprocess.run([tool, "-X", target], check=True)
gone = rules()
_netfull.ensure_rules()
print(json.dumps({"gone": gone, "again": rules() == first}))
"""
    )
    assert found == {"gone": [], "again": True}
