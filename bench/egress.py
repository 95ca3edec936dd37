"""What the egress proxy adds: latency per request and throughput, on loopback.

A local HTTP server on 127.0.0.2 (and an HTTPS one on 127.0.0.3) answers under made-up
names. The same client script (the sandbox's python, urllib, a new connection per request,
as urllib makes them) runs twice in the same run: on the host straight to the server
(direct), and inside a sandbox of the tier, where its only way out is the relay on the
sandbox's loopback and the proxy behind it. The difference of the medians is what the
proxy path adds per request. Throughput is one large download read in 1 MiB pieces: plain
HTTP through the proxy, and HTTPS through a CONNECT tunnel (the TLS is the client's and
the server's; the proxy carries bytes).

    python bench/egress.py [TIER] [--requests 300] [--mb 256]   # prints a markdown table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.egress_servers import Seen, Servers

from stockade import Limits, Sandbox
from stockade.egress import EgressProxy, _loop

CLIENT = """
import json, ssl, sys, time, urllib.request
url, count, big, tls_url, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
tls = ssl.create_default_context(cafile=ca)
opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=tls))
times = []
for _ in range(count + 20):
    t = time.perf_counter()
    opener.open(url, timeout=30).read()
    times.append(time.perf_counter() - t)
out = {"latency": times[20:]}
for name, target in (("http", big), ("https", tls_url)):
    t = time.perf_counter()
    with opener.open(target, timeout=120) as response:
        size = 0
        while True:
            chunk = response.read(1 << 20)
            if not chunk:
                break
            size += len(chunk)
    out[name] = [size, time.perf_counter() - t]
print(json.dumps(out))
"""


SERVE = """
import json, sys, tempfile
from pathlib import Path
from tests.egress_servers import servers
with tempfile.TemporaryDirectory() as folder, servers(Path(folder)) as s:
    print(json.dumps([s.http_port, s.https_port, str(s.ca_file)]), flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def served() -> Iterator[Servers]:
    """The servers in a process of their own: in this one they would share the GIL with the
    proxy (a thread handing the GIL over waits up to 5 ms, which is not the proxy's cost)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        http_port, https_port, ca = json.loads(proc.stdout.readline())
        yield Servers(http_port, https_port, Path(ca), Seen(), Seen())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tier", nargs="?", default="process")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    with served() as local:
        size = args.mb * 1024 * 1024
        names = (
            f"http://pkg.test:{local.http_port}/page",
            f"http://pkg.test:{local.http_port}/big?n={size}",
            f"https://api.test:{local.https_port}/big?n={size}",
        )
        direct_urls = [u.replace("pkg.test", "127.0.0.2").replace("api.test", "127.0.0.3") for u in names]
        # Direct: the host's python, straight to the servers (the TLS checked against the test
        # CA by the server's address, which its certificate names too), at the priority code
        # has in a sandbox (nice 19: on a busy host that alone costs milliseconds).
        done = subprocess.run(
            ["nice", "-n", "19", "/usr/bin/python3", "-c", CLIENT, direct_urls[0], str(args.requests),
             direct_urls[1], direct_urls[2], str(local.ca_file)],
            capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        direct = json.loads(done.stdout)
        network = local.policy(credentials=())  # tunnels: the proxy carries the TLS, as for pypi.org
        # The proxy alone: the same client on the host, through the proxy on a TCP port.
        proxy = EgressProxy(network)
        port = _loop.call(proxy.start_tcp())
        url = f"http://127.0.0.1:{port}"
        done = subprocess.run(
            ["nice", "-n", "19", "/usr/bin/python3", "-c", CLIENT, names[0], str(args.requests), names[1],
             names[2], str(local.ca_file)],
            capture_output=True, text=True, check=True,
            env={"PATH": "/usr/bin:/bin", "http_proxy": url, "https_proxy": url},
        )  # fmt: skip
        _loop.call(proxy.close())
        host_proxy = json.loads(done.stdout)
        with Sandbox.create(args.tier, limits=Limits(memory_mb=512, timeout_s=600), network=network) as sbx:
            sbx.files.write("client.py", CLIENT)
            sbx.files.write("ca.pem", local.ca_file.read_bytes())
            r = sbx.commands.run(
                f"python3 client.py {names[0]} {args.requests} {names[1]} {names[2]} /workspace/ca.pem",
                timeout_s=600,
            )
            assert r.exit_code == 0, r.stderr
            proxied = json.loads(r.stdout)
    rows = (("direct (host)", direct), ("proxy only (host)", host_proxy), ("proxy from the sandbox", proxied))
    print(f"## Egress proxy on the {args.tier} tier ({args.requests} requests, {args.mb} MiB downloads)\n")
    print("| measure | " + " | ".join(name for name, _ in rows) + " | added (sandbox - direct) |")
    print("|---|---|---|---|---|")
    d50 = p50_ms(direct["latency"])
    cells = " | ".join(f"{p50_ms(r['latency']):.2f} ms" for _, r in rows)
    added = p50_ms(proxied["latency"]) - d50
    print(f"| GET latency p50 (a new connection each) | {cells} | **{added:.2f} ms** |")
    p90s = [statistics.quantiles(r["latency"], n=10)[-1] * 1000 for _, r in rows]
    cells = " | ".join(f"{v:.2f} ms" for v in p90s)
    print(f"| GET latency p90 | {cells} | {p90s[2] - p90s[0]:.2f} ms |")
    for name in ("http", "https"):
        speeds = [r[name][0] / r[name][1] / 1e6 for _, r in rows]
        print(f"| {name.upper()} download | " + " | ".join(f"{v:.0f} MB/s" for v in speeds) + " | |")


if __name__ == "__main__":
    main()
