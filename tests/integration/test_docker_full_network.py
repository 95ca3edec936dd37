"""The docker tier's full network reaches the internet, never the host, the private network
or another sandbox (stockade.sandbox._netfull).

This host has no internet: what must be refused is listened for here (a listener of this
host on 0.0.0.0, one in another sandbox), and a refusal must come at once (a reset or port
unreachable, not a timeout), so that the code inside learns it fast.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from stockade import LimitNotEnforceable, NetworkPolicy, Sandbox
from stockade.sandbox import _netfull
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.docker import DockerBackend
from stockade.types import Mechanism
from tests.conftest import require_tier
from tests.integration.network_probes import host_address, listening, probe

pytestmark = pytest.mark.docker

FULL = NetworkPolicy(enabled=True)


def gateway(sbx: Sandbox) -> str:
    """The sandbox's default gateway: its bridge's address on this host."""
    route = sbx.commands.run("cat /proc/net/route").stdout.splitlines()[1].split()
    return socket.inet_ntoa(int(route[2], 16).to_bytes(4, "little"))


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A listener of this host on every address: the port."""
    with socket.create_server(("0.0.0.0", 0)) as server:
        yield server.getsockname()[1]


def test_two_full_network_sandboxes_cannot_reach_each_other() -> None:
    require_tier("docker")
    with Sandbox.create("docker", network=FULL) as a, Sandbox.create("docker", network=FULL) as b:
        assert a.enforcement.network is Mechanism.FIREWALL and not a.enforcement.weakened
        address = a.commands.run("hostname -i").stdout.split()[-1]
        with listening(a) as served:
            assert probe(b, f"{address}:8099") == {f"{address}:8099": "ConnectionRefusedError"}
        assert served == ["listening\naccepted\n"]


# Prints what Docker's embedded DNS says of each argument: an address's name, a name's address.
LOOKUP = """\
import socket, sys
for arg in sys.argv[1:]:
    try:
        print(socket.gethostbyaddr(arg)[0] if arg[0].isdigit() else socket.gethostbyname(arg))
    except OSError as err:
        print(type(err).__name__)
"""


def test_a_sandbox_learns_no_other_sandboxs_id_through_dns() -> None:
    """Docker's embedded DNS names every container of the network to the others (a reverse
    lookup of an address too): the name is random, never the sandbox's id."""
    require_tier("docker")
    with Sandbox.create("docker", network=FULL) as a, Sandbox.create("docker", network=FULL) as b:
        address = a.commands.run("hostname -i").stdout.split()[-1]
        b.files.write("lookup.py", LOOKUP)
        found = b.commands.run(["python3", "lookup.py", address, f"stockade-{a.id}"]).stdout.splitlines()
        assert len(found) == 2 and a.id not in found[0], found
        assert found[1] == "gaierror"


def test_the_host_is_unreachable_through_the_gateway_and_its_own_address(host_listener: int) -> None:
    require_tier("docker")
    own = host_address()
    with Sandbox.create("docker", network=FULL) as sbx:
        targets = [f"{gateway(sbx)}:{host_listener}", "172.17.0.1:" + str(host_listener)]
        targets += [f"{own}:{host_listener}"] if own else []
        assert probe(sbx, *targets) == dict.fromkeys(targets, "ConnectionRefusedError")


def test_private_and_metadata_addresses_fail_fast() -> None:
    require_tier("docker")
    targets = ["169.254.169.254:80", "10.1.2.3:80", "192.168.77.1:443", "100.64.0.1:80", "172.31.0.9:22"]
    with Sandbox.create("docker", network=FULL) as sbx:
        # Refused, not timed out (a drop would raise TimeoutError after the probe's 10 s).
        assert probe(sbx, *targets) == dict.fromkeys(targets, "ConnectionRefusedError")


def test_the_rules_are_one_set_for_every_sandbox() -> None:
    """Each start checks the jumps; none is added twice, however many sandboxes started."""
    require_tier("docker")
    for _ in range(2):
        Sandbox.create("docker", network=FULL).close()
    for chain, target in (("DOCKER-USER", _netfull.FORWARD_CHAIN), ("INPUT", _netfull.INPUT_CHAIN)):
        rules = subprocess.run(["iptables", "-w", "-S", chain], capture_output=True, text=True, check=True)
        assert rules.stdout.count(f"-j {target}") == 1, rules.stdout


def test_an_engine_whose_firewall_is_not_ours_needs_consent() -> None:
    """A remote engine's host firewall is not stockade's: refused, and a fix given, unless
    allow_weaker (then the plan says what the sandbox reaches)."""
    require_tier("docker")
    remote = DockerBackend(remote=True)
    with pytest.raises(LimitNotEnforceable, match="another host") as refused:
        Sandbox.create(backend=remote, network=FULL)
    assert refused.value.setting == "network" and "allow_weaker" in refused.value.fix
    plan = remote._plan(SandboxSpec(network=FULL, allow_weaker=True))
    assert plan.network is Mechanism.NONE
    assert any("private addresses" in w for w in plan.weakened)


def test_gc_network_keeps_a_network_in_use_and_says_so() -> None:
    """`stockade gc --network` beside a live full-network sandbox: the network and its walls
    stay (the engine refuses to remove a network in use), and the command says why."""
    require_tier("docker")
    with Sandbox.create("docker", network=FULL) as sbx:
        gc = subprocess.run(
            [sys.executable, "-m", "stockade.cli.main", "gc", "--network"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert gc.returncode == 0, gc.stderr
        assert f"kept {_netfull.NETWORK} and its firewall rules" in gc.stdout, gc.stdout
        assert sbx.enforcement.network is Mechanism.FIREWALL
        assert probe(sbx, "10.1.2.3:80") == {"10.1.2.3:80": "ConnectionRefusedError"}
