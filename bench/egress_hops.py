"""Where the egress path's time goes, hop by hop: one small GET, a new connection each.

The same raw-socket client (no urllib: only connect, send, read to the end, close) runs
against each part of the path, interleaved in rounds, so the differences are the hops:

* on the host: straight to the server ("direct"), and through the proxy on a TCP port;
* inside a sandbox of the tier: to a server in the sandbox on its own loopback (what one
  connection over the sandbox's loopback costs: gVisor's netstack on that tier), to the
  proxy's socket bound into the sandbox without the relay, through the relay
  (127.0.0.1:3128, where HTTP_PROXY points), and to that port as the sandbox's programs
  connect (on gVisor the connect shortcut preloaded into them takes them to the proxy's
  socket; elsewhere the relay again).

Beside the times, the CPU the proxies' thread spent per request in each way (its
``thread_time``; both proxies, the host's and the sandbox's, run on it): what the proxy
itself costs, which the host's load moves much less than it moves the latencies.

    python bench/egress_hops.py [TIER] [--requests 200] [--rounds 3]   # a markdown table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from egress import served

from stockade import Limits, Sandbox
from stockade.egress import EgressProxy, _loop

CLIENT = """
import json, socket, subprocess, sys, time
mode, target, request, count = sys.argv[1], sys.argv[2], sys.argv[3].encode(), int(sys.argv[4])
server = None
if mode == "loopback":  # a server on the sandbox's own loopback, in a process of its own
    server = subprocess.Popen([sys.executable, "-c", '''
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 3999)); s.listen(64); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 OK\\\\r\\\\nContent-Length: 2\\\\r\\\\nConnection: close\\\\r\\\\n\\\\r\\\\nok")
    c.close()
'''], stdout=subprocess.PIPE)
    server.stdout.readline()
    target = "127.0.0.1:3999"

def connect():
    if target.startswith("/"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(target)
        return s
    host, port = target.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

times = []
for _ in range(count + 20):
    t = time.perf_counter()
    s = connect()
    s.sendall(request)
    while s.recv(65536):
        pass
    s.close()
    times.append(time.perf_counter() - t)
if server is not None:
    server.kill(); server.wait()
print(json.dumps(times[20:]))
"""


def run_host(target: str, request: str, count: int) -> list[float]:
    argv = ["nice", "-n", "19", "/usr/bin/python3", "-c", CLIENT, "host", target, request, str(count)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    times: list[float] = json.loads(done.stdout)
    return times


def run_sandbox(
    sbx: Sandbox, mode: str, target: str, request: str, count: int, *, shortcut: bool = False
) -> list[float]:
    # Without the connect shortcut (gVisor preloads it into the sandbox's programs) unless
    # asked: each way is then the hop it names.
    unset = [] if shortcut else ["env", "-u", "LD_PRELOAD"]
    r = sbx.commands.run([*unset, "python3", "hops.py", mode, target, request, str(count)], timeout_s=600)
    assert r.exit_code == 0, r.stderr
    times: list[float] = json.loads(r.stdout)
    return times


async def _thread_cpu() -> float:
    return time.thread_time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tier", nargs="?", default="gvisor")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    with served() as local:
        network = local.policy(credentials=(), max_requests_per_minute=10**6, max_bytes_per_minute=10**12)
        proxy = EgressProxy(network)
        port = _loop.call(proxy.start_tcp())
        head = "HTTP/1.1\r\nHost: pkg.test\r\nConnection: close\r\n\r\n"
        absolute = f"GET http://pkg.test:{local.http_port}/page {head}"
        origin = f"GET /page {head}"
        sbx = Sandbox.create(args.tier, limits=Limits(memory_mb=512, timeout_s=600), network=network)
        try:
            sbx.files.write("hops.py", CLIENT)
            ways: dict[str, Any] = {
                "host: direct to the server": lambda: run_host(
                    f"127.0.0.2:{local.http_port}", origin, args.requests
                ),
                "host: through the proxy (TCP)": lambda: run_host(
                    f"127.0.0.1:{port}", absolute, args.requests
                ),
                "sandbox: its own loopback (a server inside)": lambda: run_sandbox(
                    sbx, "loopback", "", origin, args.requests
                ),
                "sandbox: the proxy's socket, no relay": lambda: run_sandbox(
                    sbx, "socket", "/run/stockade-egress/proxy.sock", absolute, args.requests
                ),
                "sandbox: through the relay (127.0.0.1:3128)": lambda: run_sandbox(
                    sbx, "relay", "127.0.0.1:3128", absolute, args.requests
                ),
                "sandbox: 127.0.0.1:3128 as shipped (gVisor: the connect shortcut)": lambda: run_sandbox(
                    sbx, "relay", "127.0.0.1:3128", absolute, args.requests, shortcut=True
                ),
            }
            results: dict[str, list[list[float]]] = {way: [] for way in ways}
            cpu: dict[str, list[float]] = {way: [] for way in ways}  # the proxies' thread, per request
            for _ in range(args.rounds):
                for way, run in ways.items():
                    before = _loop.call(_thread_cpu())
                    results[way].append(run())
                    cpu[way].append((_loop.call(_thread_cpu()) - before) / (args.requests + 20))
                load.append(os.getloadavg()[0])
        finally:
            sbx.close()
            _loop.call(proxy.close())
    print(f"## Egress hops on the {args.tier} tier ({args.rounds} rounds of {args.requests} GETs, a new "
          f"connection each, interleaved; load average {min(load):.1f}-{max(load):.1f})\n")  # fmt: skip
    print("| way | p50 (all) | p50 per round | p90 | proxy CPU per request |")
    print("|---|---|---|---|---|")
    for way, rounds in results.items():
        samples = [t for r in rounds for t in r]
        per = " / ".join(f"{statistics.median(r) * 1000:.2f}" for r in rounds)
        p90 = statistics.quantiles(samples, n=10)[-1] * 1000
        p50 = statistics.median(samples) * 1000
        used = statistics.median(cpu[way]) * 1e6
        print(f"| {way} | {p50:.2f} ms | {per} | {p90:.2f} ms | {used:.0f} µs |")


if __name__ == "__main__":
    main()
