"""Warm pools on every tier: clean hand-outs, recycling, replacement of broken members."""

from __future__ import annotations

import threading

import pytest

from stockade import Limits, SandboxRules
from stockade import exceptions as exc
from stockade.sandbox.pool import SandboxPool
from stockade.types import CommandResult, Execution
from tests.conftest import wait_for


def test_a_returned_sandbox_comes_back_clean(tier: str) -> None:
    with SandboxPool(tier, size=1, max_uses=10, limits=Limits(timeout_s=20)) as pool:
        with pool.acquire() as sbx:
            first = sbx.id
            sbx.files.write("secret.txt", "from user one")
            sbx.run_code("leftover = 'state'")
            sbx.commands.run("echo tmp > /tmp/t")
        with pool.acquire() as sbx:
            assert sbx.id == first, f"replaced, not recycled: {pool.stats().last_replaced_why}"
            assert sbx.files.list() == []
            assert sbx.run_code("'leftover' in dir()").text == "False"
            assert sbx.commands.run("ls /tmp").stdout == ""


def test_members_are_replaced_after_max_uses(tier: str) -> None:
    with SandboxPool(tier, size=1, max_uses=1) as pool:
        with pool.acquire() as sbx:
            first = sbx.id
        with pool.acquire() as sbx:
            assert sbx.id != first
        assert pool.stats().replaced >= 1


def test_a_broken_member_is_replaced_not_handed_out(tier: str) -> None:
    with SandboxPool(tier, size=2) as pool:
        wait_for(lambda: pool.stats().ready == 2, what="a full pool", timeout_s=30)
        with pool.acquire() as sbx:
            sbx.instance.close()  # dies while in use
        with pool.acquire() as a, pool.acquire() as b:
            assert a.alive and b.alive
            assert a.commands.run("echo ok").stdout == "ok\n"
            assert b.commands.run("echo ok").stdout == "ok\n"


def test_the_pool_refills_in_the_background(tier: str) -> None:
    with SandboxPool(tier, size=2) as pool:
        wait_for(lambda: pool.stats().ready == 2, what="a full pool", timeout_s=30)
        with pool.acquire():
            wait_for(lambda: pool.stats().ready + pool.stats().in_use >= 2, what="the refill", timeout_s=30)


def test_idle_members_are_replaced(tier: str) -> None:
    with SandboxPool(tier, size=1, idle_timeout_s=0.3) as pool:
        wait_for(lambda: pool.stats().started >= 1, what="a start", timeout_s=30)
        wait_for(
            lambda: pool.stats().replaced >= 1 and pool.stats().ready == 1, what="a replacement", timeout_s=30
        )


def test_a_handle_kept_past_its_block_never_reaches_the_next_user(tier: str) -> None:
    with SandboxPool(tier, size=1, max_uses=10) as pool:
        with pool.acquire() as mine:
            mine.files.write("mine.txt", "one")
        with pool.acquire() as theirs:
            theirs.files.write("key.txt", "user two's")
            for call in (
                lambda: mine.files.read("key.txt"),
                lambda: mine.run_code("import builtins; builtins.print = None"),
                lambda: mine.commands.run("rm -f key.txt"),
            ):
                with pytest.raises(exc.SandboxClosed, match="went back to its pool"):
                    call()
            mine.close()  # harmless: it closes nothing of theirs
            assert not mine.alive and theirs.alive
            assert theirs.files.read("key.txt") == "user two's"
            assert "mine" in str(theirs.run_code("print('mine')").logs.stdout)


def test_a_handle_kept_past_its_block_cuts_nothing_of_the_next_users(tier: str) -> None:
    """A watchdog kept ``sbx.instance`` to cut a call at its deadline: after the block its cut
    killed the next user's code (KernelDied, the interpreter restarted) and command (137)."""
    with SandboxPool(tier, size=1, max_uses=10, limits=Limits(timeout_s=60)) as pool:
        with pool.acquire() as mine:
            kept = mine.instance
        with pool.acquire() as theirs:
            waits = "import os, time\nopen('running', 'w').close()\n"
            waits += "while not os.path.exists('go'): time.sleep(0.05)\n"
            ended: list[object] = []
            for call in (
                lambda: theirs.run_code(waits + "print('finished')"),
                lambda: theirs.commands.run(
                    "touch running; while [ ! -e go ]; do sleep 0.05; done; echo finished"
                ),
            ):
                user = threading.Thread(target=lambda call=call: ended.append(call()))
                user.start()
                wait_for(lambda: theirs.files.exists("running"), what="the next user's call", timeout_s=30)
                kept.cut_running()
                theirs.files.write("go", "")
                user.join(30)
                theirs.files.remove("running")
                theirs.files.remove("go")
            code, command = ended
            assert isinstance(code, Execution) and isinstance(command, CommandResult)
            assert code.error is None and code.logs.stdout == "finished\n" and not code.timed_out
            assert command.exit_code == 0 and command.stdout == "finished\n" and not command.timed_out


def test_every_user_of_a_pool_under_rules_is_under_them(tier: str) -> None:
    # test_policy_inside's limits and rules for its copies of curl: on the microVM a denied
    # program is masked on the guest's command line, a machine of its own whose boot and ready
    # images (seconds each under TCG) the run builds once for both tests, not once for each.
    rules = SandboxRules(deny=("curl",))
    limits = Limits(memory_mb=256, timeout_s=30, pids=64)
    with SandboxPool(tier, size=1, limits=limits, rules=rules, allow_weaker=tier == "gvisor") as pool:
        for user in ("one", "two"):
            with pool.acquire() as sbx:
                r = sbx.commands.run("curl --version")
                assert r.exit_code != 0 and "libcurl" not in r.stdout, (user, r)
                assert sbx.commands.run("echo fine").stdout == "fine\n"
        assert pool.stats().recycled >= 1, "a reset under rules is in place: the member is kept"


# The last user's code leaves sockets that no process holds: unix socket pairs in flight inside
# one another (SCM_RIGHTS to themselves) with full queues, charged to the sandbox's memory,
# one of them bound to an abstract name; and a connection it closed first, in TIME_WAIT from
# an address and port it chose.
LEAVE_SOCKETS = """
import array, socket
def in_flight(s):
    s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [s.fileno()]))])
for i in range(20):
    p1, p2 = socket.socketpair()
    if i == 0:
        p1.bind("\\0left-by-the-last-user")
    for s in (p1, p2):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    in_flight(p2); in_flight(p1); p2.setblocking(False)
    try:
        while True: p2.send(bytes(65536))
    except BlockingIOError: pass
    p1.close(); p2.close()
server = socket.socket(); server.bind(("127.0.0.1", 9000)); server.listen()
client = socket.socket(); client.bind(("127.1.2.3", 8000)); client.connect(("127.0.0.1", 9000))
conn, _ = server.accept(); client.send(b"bytes of the last user"); client.close()
conn.recv(100); conn.close()  # read: unread data would reset the connection, not close it
print("left")
"""
NEXT_USER = """
import socket
a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); a.bind("\\0left-by-the-last-user")
b = socket.socket(); b.bind(("0.0.0.0", 8000))
memory = bytearray(150 << 20)
memory[::4096] = b"x" * len(memory[::4096])
print(open("/proc/net/tcp").read().count("0302017F:1F40"), open("/proc/net/unix").read().count("left-by"))
"""


def test_no_socket_of_one_user_reaches_the_next(tier: str) -> None:
    """The next user gets the sandbox's whole memory at once, binds the ports and names the last
    one used, and sees nothing of its connections: the reset found what the kernel kept and
    the pool handed out a fresh member, or the tier kept none (no TIME_WAIT in the namespace)."""
    with SandboxPool(tier, size=1, max_uses=10, limits=Limits(memory_mb=256, timeout_s=30)) as pool:
        with pool.acquire() as sbx:
            assert sbx.run_code(LEAVE_SOCKETS).logs.stdout == "left\n"
        with pool.acquire() as sbx:
            result = sbx.run_code(NEXT_USER)
            assert result.error is None, result
            assert result.logs.stdout == "0 1\n", result  # its own name only
