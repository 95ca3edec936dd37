"""The API's overhead: ``--clients`` concurrent clients each create a sandbox, ``run_code``
in it and delete it, through ``stockade serve`` (embedded, on 127.0.0.1), against the same
work through the SDK in this process (one thread per client). Reported per request: p50/p99
of each step and the whole, the ratio service/SDK, and the server's memory before, right
after and a while after the load (flat: the sandboxes' records are gone).

    python bench/service_sandboxes.py [--clients 200] [--rounds 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _service import percentile, rss_mb, server, tenants_file

from stockade import Limits, Sandbox
from stockade.client import Client, RemoteSandbox

LIMITS = Limits(memory_mb=128, pids=32, timeout_s=30)


def load(clients: int, rounds: int, make: Callable[[], object]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"create": [], "run_code": [], "delete": [], "total": []}
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client() -> None:
        barrier.wait()
        for _ in range(rounds):
            t0 = time.perf_counter()
            sbx = make()
            t1 = time.perf_counter()
            assert sbx.run_code("print(1)").logs.stdout == "1\n"  # type: ignore[attr-defined]
            t2 = time.perf_counter()
            sbx.close()  # type: ignore[attr-defined]
            t3 = time.perf_counter()
            with lock:
                for key, value in (("create", t1 - t0), ("run_code", t2 - t1), ("delete", t3 - t2),
                                   ("total", t3 - t0)):  # fmt: skip
                    times[key].append(value)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def show(name: str, times: dict[str, list[float]]) -> None:
    parts = [
        f"{k} p50 {percentile(v, 50) * 1000:.0f} / p99 {percentile(v, 99) * 1000:.0f} ms"
        for k, v in times.items()
    ]
    print(f"{name}: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    Sandbox.create("process", limits=LIMITS).close()  # warm, as the server is below
    sdk = load(args.clients, args.rounds, lambda: Sandbox.create("process", limits=LIMITS))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tenants, token = tenants_file(folder)
        with server(folder, tenants, f"sqlite:///{folder / 'service.db'}") as (url, proc):
            client = Client(url, token, timeout_s=600)
            RemoteSandbox.create("process", limits=LIMITS, client=client).close()  # warm
            before = rss_mb(proc.pid)

            def make() -> RemoteSandbox:
                return RemoteSandbox.create("process", limits=LIMITS, client=client)

            remote = load(args.clients, args.rounds, make)
            after = rss_mb(proc.pid)
            remote2 = load(args.clients, args.rounds, make)
            time.sleep(5)
            later = rss_mb(proc.pid)
            left = client.sandboxes()
            client.close()
    show("SDK in-process", sdk)
    show("through the API", remote)
    show("through the API, again", remote2)
    for key in ("create", "run_code", "delete", "total"):
        ratio = percentile(remote[key], 50) / max(percentile(sdk[key], 50), 1e-9)
        print(f"ratio service/SDK, {key} p50: {ratio:.2f}x")
    print(f"server RSS: {before:.0f} MB before, {after:.0f} MB after {args.clients} clients, "
          f"{later:.0f} MB after a second load; sandboxes left: {len(left)}")  # fmt: skip


if __name__ == "__main__":
    main()
