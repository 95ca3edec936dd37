"""What one sandbox's flood of its egress proxy costs another sandbox's requests.

    python bench/egress_flood.py [--requests 200] [--connections 8]

Every sandbox's proxy runs on one event loop thread (``egress/_loop.py``). Two proxies, A
(allows nothing) and B (allows a local HTTP server), as two sandboxes of one host process
have them; B's same allowed GET (a new connection each) is timed with A idle, then while a
process of its own floods A with request heads of 12,500 one-line headers (62 KB, under the
64 KiB cap) on ``--connections`` connections. Prints B's p50 and p90 each way, and the ratio
of the p50s (the same request on both sides; 1.0 is a flood that costs B nothing).
"""

from __future__ import annotations

import argparse
import http.server
import socket
import statistics
import subprocess
import sys
import threading
import time

from stockade.egress import EgressProxy, NetworkPolicy, _loop

FLOODER = r"""
import socket, sys, threading
port, connections = int(sys.argv[1]), int(sys.argv[2])
head = b"GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\n" + b"a:b\r\n" * 12_497 + b"\r\n"

def flood():
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(head)
                while conn.recv(65536):
                    pass
        except OSError:
            pass

for _ in range(connections):
    threading.Thread(target=flood, daemon=True).start()
threading.Event().wait()
"""


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:  # its signature
        pass


def _get(proxy_port: int, upstream: int) -> float:
    where = f"localhost:{upstream}"
    request = f"GET http://{where}/ HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n"
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", proxy_port)) as conn:
        conn.settimeout(30)
        conn.sendall(request.encode())
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok"), answer[:200]
    return (time.perf_counter() - started) * 1000


def _timed(proxy_port: int, upstream: int, requests: int) -> list[float]:
    return [_get(proxy_port, upstream) for _ in range(requests)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = server.server_address[1]
    a = EgressProxy(NetworkPolicy())
    b = EgressProxy(NetworkPolicy(allow_hosts=(f"localhost:{upstream}",), allow_addresses=("127.0.0.0/8",)))
    a_port, b_port = _loop.call(a.start_tcp()), _loop.call(b.start_tcp())
    try:
        _timed(b_port, upstream, 10)  # warm
        idle = _timed(b_port, upstream, args.requests)
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(a_port), str(args.connections)])
        try:
            time.sleep(1.0)  # its connections open
            flooded = _timed(b_port, upstream, args.requests)
        finally:
            flooder.kill()
            flooder.wait()
    finally:
        _loop.call(a.close())
        _loop.call(b.close())
        server.shutdown()
    for name, values in (("A idle", idle), ("A flooding", flooded)):
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"B's GET, {name}: p50 {statistics.median(values):.2f} ms, p90 {p90:.2f} ms")
    print(f"ratio (flooding / idle, p50): {statistics.median(flooded) / statistics.median(idle):.2f}x")


if __name__ == "__main__":
    main()
