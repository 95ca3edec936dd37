"""Runs through the distributed service: ``--runs`` scripted-model runs submitted at once to
``--workers`` workers (Celery over Redis, PostgreSQL for state) on this machine.

Each run writes a file, pays an "invoice" idempotency key into its diff (a second write),
and answers: three model turns, two tool calls, on the process tier. Measured: runs/s from the
first submission to the last run done, submit-to-done p50/p99, and the checks: none lost (every
run ends success), none run twice (one start each in the audit trail) and no side effect
repeated (each run's diff holds its write once).

    python bench/service_runs.py [--runs 1000] [--workers 2] [--postgres URL] [--redis URL]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _service import percentile, postgres_schema, redis_prefix, server, tenants_file, workers

from stockade.client import Client


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1, help="runs at once per worker")
    parser.add_argument("--postgres", default="postgresql://stockade:stockade@127.0.0.1:5432/stockade")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, postgres_schema(args.postgres) as db, \
            redis_prefix(args.redis) as queue:  # fmt: skip
        folder = Path(tmp)
        tenants, token = tenants_file(folder)
        pool = workers(
            folder, tenants, db, args.redis, queue, count=args.workers, concurrency=args.concurrency
        )
        with server(folder, tenants, db, redis=args.redis, queue=queue) as (url, _), pool:
            client = Client(url, token, timeout_s=300)
            submitted: dict[str, float] = {}

            def submit(i: int) -> None:
                turns = [{"name": "write_file", "args": {"path": f"out/{i}.txt", "content": f"run {i}\n"}},
                         {"name": "read_file", "args": {"path": f"out/{i}.txt"}}, f"done {i}"]  # fmt: skip
                run = client.runs.submit(f"bench {i}", scripted=turns, labels={"bench": "1"})
                submitted[run.id] = time.time()

            start = time.time()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(submit, range(args.runs)))
            submit_s = time.time() - start
            done: dict[str, dict[str, object]] = {}
            deadline = time.monotonic() + 3600
            while len(done) < len(submitted) and time.monotonic() < deadline:
                for run in client.runs.list(limit=1000, status="success") + client.runs.list(
                    limit=1000, status="error"
                ):
                    done.setdefault(run.id, run.info)
                time.sleep(1.0)
            end = max(float(str(info["finished_at"])) for info in done.values())
            latencies = [float(str(info["finished_at"])) - submitted[rid] for rid, info in done.items()]
            statuses = {str(info["status"]) for info in done.values()}
            attempts = [int(str(info["attempts"])) for info in done.values()]
            sample = list(done)[:50]
            repeated = [rid for rid in sample if client.runs.get(rid).diff().count("+++ b/out/") != 1]
            starts = [rid for rid in sample if sum(1 for e in client.runs.get(rid).events()
                                                   if e.kind == "run_start") != 1]  # fmt: skip
            listed = ", ".join(sorted(statuses))
            print(f"runs: {len(done)}/{args.runs} done ({listed}), submitted in {submit_s:.1f} s")
            print(f"throughput: {len(done) / (end - start):.1f} runs/s on {args.workers} workers")
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            print(f"submit-to-done: p50 {p50:.2f} s, p99 {p99:.2f} s")
            print(f"attempts: max {max(attempts)}; diffs with a repeated write (of 50): {len(repeated)}; "
                  f"runs started twice (of 50): {len(starts)}")  # fmt: skip
            print(f"audit: {client.verify_audit()['summary']}")
            client.close()


if __name__ == "__main__":
    main()
