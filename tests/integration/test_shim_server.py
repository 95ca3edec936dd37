"""The shim server (supervisor/shimserver.py) makes every command's shim: a clone of a process
that holds nothing of any user, whose parent is the supervisor (CLONE_PARENT). Code runs as
its uid and may kill, stop or reconfigure it: a command then still runs (in a shim forked
from the supervisor, as before the server), and the next reset replaces it.

The server names itself, and so its shims (which exec nothing themselves), ``stockade-shim``:
that is how these tests tell a shim the server made from a fork of the supervisor. gVisor
ignores CLONE_PARENT (the clone would be the server's child): there the server says so and
ends, and every shim is a fork of the supervisor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stockade import Limits, Sandbox
from stockade.types import SandboxRules
from tests.conftest import require_tier
from tests.integration.conftest import TIERS

NAME = "stockade-shim"
CLONES = ("process", "docker", "microvm")  # a kernel that honours CLONE_PARENT
LIMITS = Limits(memory_mb=256, timeout_s=20, pids=64)

# Run as a command: its shim leads its session; the shim's parent is the supervisor, whose
# children are the zygote, the shim server and the shims of the commands running.
LOOK = r"""
import json, os, resource

def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as fh:
        data = fh.read()
    return data[data.rindex(b")") + 2 :].split()

def comm(pid):
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()

def settings(pid):
    names = sorted(n for n in dir(resource) if n.startswith("RLIMIT_"))
    return [
        [list(resource.prlimit(pid, getattr(resource, n))) for n in names],
        os.getpriority(os.PRIO_PROCESS, pid),
        sorted(os.sched_getaffinity(pid)),
        os.sched_getscheduler(pid),
    ]

shim = os.getsid(0)
supervisor = int(stat(shim)[1])
children = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(stat(int(p))[1]) == supervisor]
servers = [p for p in children if p != shim and comm(p) == "stockade-shim"]
print(json.dumps({
    "shim": comm(shim),
    "servers": servers,
    "stopped": [stat(p)[0].decode() in "TtZXx" for p in servers],
    "as the supervisor": [settings(p) == settings(supervisor) for p in servers],
}))
"""


def look(sbx: Sandbox, tier: str) -> dict[str, Any]:
    """What LOOK finds, once the server has said it can clone here: the commands before that
    (a sandbox's first, or more on a loaded machine) are forks of the supervisor."""
    deadline = time.monotonic() + 10
    while True:
        result = sbx.commands.run(["python3", "-c", LOOK])
        assert result.exit_code == 0, result.stderr
        found = json.loads(result.stdout)
        assert isinstance(found, dict)
        if tier not in CLONES or found["shim"] == NAME or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def sbx(tier: str) -> Iterator[Sandbox]:
    with Sandbox.create(tier, limits=LIMITS) as sandbox:
        yield sandbox


def test_a_commands_shim_is_made_by_the_server_as_the_supervisors_child(sbx: Sandbox, tier: str) -> None:
    found = look(sbx, tier)
    if tier in CLONES:
        assert found["shim"] == NAME, "the command's shim is a clone of the server's"
        assert len(found["servers"]) == 1
        assert found["as the supervisor"] == [True], "every shim inherits the server's settings"
    else:  # gVisor: the server said it cannot, and ended
        assert found["shim"] != NAME
        assert found["servers"] == []


# What code of the server's uid can do to it: each leaves commands running, and the reset
# replaces the server (a fresh supervisor forks a new one).
TAMPERS = {
    "killed": "kill -KILL {pid}",
    "stopped": "kill -STOP {pid}",
    "open files limit lowered": (
        "python3 -c 'import resource as r; "
        "r.prlimit({pid}, r.RLIMIT_NOFILE, (64, r.prlimit({pid}, r.RLIMIT_NOFILE)[1]))'"
    ),
    "nice raised": "python3 -c 'import os; os.setpriority(os.PRIO_PROCESS, {pid}, 10)'",
}


@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_commands_run_whatever_code_does_to_the_server_and_the_reset_replaces_it(
    sbx: Sandbox, tier: str, tamper: str
) -> None:
    if tier not in CLONES:
        return  # no server there (the test above)
    (server,) = look(sbx, tier)["servers"]
    done = sbx.commands.run(TAMPERS[tamper].format(pid=server))
    assert done.exit_code == 0, done.stderr
    for _ in range(3):  # a stopped server is given up on; the later commands fork at once
        assert sbx.commands.run("echo still running", timeout_s=10).stdout == "still running\n"
    sbx.reset()
    after = look(sbx, tier)
    assert after["shim"] == NAME
    assert after["servers"] != [server] and len(after["servers"]) == 1, "a new server"
    assert after["stopped"] == [False] and after["as the supervisor"] == [True]


def test_a_timed_out_commands_whole_tree_is_killed(sbx: Sandbox, tier: str) -> None:
    assert (look(sbx, tier)["shim"] == NAME) == (tier in CLONES)
    # Two sleeps left behind, one of them double-forked away from its shell.
    ran = sbx.commands.run("sleep 61 & (sleep 62 &); sleep 63", timeout_s=1)
    assert ran.timed_out
    left = sbx.commands.run(["python3", "-c", SLEEPS])
    assert left.stdout == "[]\n"


SLEEPS = r"""
import os
found = []
for p in os.listdir("/proc"):
    try:
        with open(f"/proc/{p}/cmdline", "rb") as fh:
            line = fh.read()
    except OSError:
        continue
    if line.startswith(b"sleep\0" + b"6"):
        found.append(line)
print(found)
"""


@pytest.mark.parametrize("tier", [t for t in TIERS if t in CLONES])
def test_the_exec_judge_refuses_what_the_rules_deny_under_a_shim_the_server_made(tier: str) -> None:
    # The compiled judge lets by only the execs of a session whose leader is the supervisor's
    # child (waitid(WNOWAIT) on the leader): a clone of the server must be one. `uname` is
    # masked and refused, `rm -r` needs an approval nobody gives: the judge's refusal.
    require_tier(tier)
    rules = SandboxRules(deny=("uname",), approve=("rm -r",))
    with Sandbox.create(tier, limits=LIMITS, rules=rules) as sbx:
        look(sbx, tier)  # the server serves from here on
        leader = "cat /proc/$(cut -d' ' -f6 /proc/self/stat)/comm"
        ran = sbx.commands.run(f"{leader}; /bin/true allowed; uname; /bin/uname; rm -r nothing")
        assert ran.stdout == f"{NAME}\n", ran.stdout  # no "Linux": uname did not run
        verdicts = [(e.argv, e.verdict) for e in ran.execs]
        assert (("/bin/true", "allowed"), "allow") in verdicts
        assert (("rm", "-r", "nothing"), "refuse") in verdicts
