"""What the whole-network tests try from inside a sandbox: connects, a listener, and this
host's own address to aim them at (tests/integration/test_*_full_network.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from stockade import Sandbox

# Prints what a connect to each HOST:PORT argument came to: "connected", or the error's name.
PROBE = """\
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
        print(target, "connected")
    except OSError as err:
        print(target, type(err).__name__)
"""

LISTEN = """\
import socket
s = socket.socket()
s.bind(("0.0.0.0", 8099))
s.listen()
s.settimeout(30)
print("listening", flush=True)
try:
    s.accept()
    print("accepted")
except OSError:
    print("nobody came")
"""


def probe(sbx: Sandbox, *targets: str) -> dict[str, str]:
    sbx.files.write("probe.py", PROBE)
    result = sbx.commands.run(["python3", "probe.py", *targets])
    assert result.exit_code == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


@contextlib.contextmanager
def listening(sbx: Sandbox) -> Iterator[list[str]]:
    """``sbx`` listening on its port 8099 while the block runs; then its own connect ends the
    listener's wait (a sandbox reaches its own listener), and the list holds what it printed."""
    sbx.files.write("listen.py", LISTEN)
    ready = threading.Event()
    served: list[str] = []
    server = threading.Thread(
        target=lambda: served.append(
            sbx.commands.run("python3 listen.py", on_stdout=lambda _: ready.set()).stdout
        )
    )
    server.start()
    try:
        assert ready.wait(30)
        yield served
    finally:
        assert probe(sbx, "127.0.0.1:8099") == {"127.0.0.1:8099": "connected"}
        server.join(40)


def host_address() -> str | None:
    """This host's address on its default route's interface (what a UDP socket would send from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect(("192.0.2.1", 9))  # no packet is sent
        except OSError:
            return None
        address: str = udp.getsockname()[0]
    return None if address.startswith("127.") else address
