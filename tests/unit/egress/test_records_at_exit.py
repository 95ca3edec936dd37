"""The records of a proxy its host never closed still reach the audit trail when the host's
interpreter exits (a program that ends, or one that dies of an exception; not a SIGKILL).

A record is told to the observer on the proxy loop's next turn, on a daemon thread that the
interpreter freezes as it finalizes; the audit log writes in batches from another daemon
thread. Each run is a new interpreter that makes requests through a proxy observed by an
``AuditLog`` over SQLite, closes neither, and exits; the trail must then hold one ``egress``
event per request, the one still in flight at the exit as cut (status 0). Whichever was
imported or started first: the proxies close before the logs flush.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.audit.events import EventKind
from stockade.audit.stores import SQLiteStore
from tests.conftest import require

HOST = r"""
import os, socket, sys, threading, time
from stockade.egress import EgressProxy, NetworkPolicy, _loop

server = socket.create_server(("127.0.0.2", 0))
server_port = server.getsockname()[1]
held = []

def serve():
    while True:
        conn, _ = server.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(4096)
        if b"/hang" in data:
            held.append(conn)  # never answered: in flight when the host exits
            continue
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        conn.close()

threading.Thread(target=serve, daemon=True).start()
log = None

def open_log():  # the audit package imported here, and not before, when the proxy is first
    global log, EventKind
    from stockade.audit.events import EventKind
    from stockade.audit.log import AuditLog
    from stockade.audit.stores import SQLiteStore
    log = AuditLog(SQLiteStore(sys.argv[1]))

if sys.argv[4] == "log":
    open_log()
policy = NetworkPolicy(
    allow_hosts=(f"raw.test:{server_port}",), allow_addresses=("127.0.0.2/32",),
    resolve={"raw.test": ("127.0.0.2",)},
)
def observe(record):
    log.record(EventKind.EGRESS, run_id="r", attributes={"status": record.status, "path": record.path})

proxy = EgressProxy(policy, observer=observe)
port = _loop.call(proxy.start_tcp())
if sys.argv[4] == "proxy":
    open_log()

def get(path):
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    client.sendall(f"GET http://raw.test:{server_port}{path} HTTP/1.1\r\nHost: raw.test\r\n\r\n".encode())
    return client

for i in range(int(sys.argv[2])):
    with get(f"/{i}") as client:
        answer = b""
        while not answer.endswith(b"ok"):
            answer += client.recv(4096)
hanging = get("/hang")
while not held:
    time.sleep(0.01)
if sys.argv[3] == "raise":
    raise SystemExit("the host's program failed")  # an exception ends it: the same exit
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("ending", ["return", "raise"])
def test_records_of_a_proxy_left_open_reach_the_trail_at_exit(tmp_path: Path, loop: str, ending: str) -> None:
    if loop == "uvloop":
        require(
            "uvloop",
            importlib.util.find_spec("uvloop") is not None,
            "the egress-fast extra (dev installs it)",
        )
    _left_open_at_exit(tmp_path, loop, ending, first="log")


def test_the_proxy_closes_before_the_log_flushes_whichever_came_first(tmp_path: Path) -> None:
    # Each kept its own exit hook, and the proxy's ran first only because it registered it
    # again at each start, after the log's (registered when the audit package was imported).
    _left_open_at_exit(tmp_path, "asyncio", "return", first="proxy")


def _left_open_at_exit(tmp_path: Path, loop: str, ending: str, *, first: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STOCKADE_EGRESS_LOOP": loop}
    requests = 5
    for run in range(3):  # before the fix, most runs lost the last records (16 of 20)
        db = tmp_path / f"audit-{run}.db"
        done = subprocess.run(
            [sys.executable, "-c", HOST, str(db), str(requests), ending, first],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == (0 if ending == "return" else 1), done.stderr
        store = SQLiteStore(db)
        try:
            events = [e for e in store.events() if e.kind == EventKind.EGRESS]
        finally:
            store.close()
        statuses = sorted((str(e.attributes["path"]), int(str(e.attributes["status"]))) for e in events)
        assert statuses == sorted([(f"/{i}", 200) for i in range(requests)] + [("/hang", 0)]), run
