"""The capacity curve: many workers against one Redis and one PostgreSQL, on this machine.

For each worker count (``--workers 1,2,4``, one run at a time each) ``--runs`` scripted runs
(an instant model) are submitted at once through ``stockade serve``; measured: runs/s, the
submit-to-done p50/p99, the CPU seconds per run of the workers, the API server, PostgreSQL
and Redis, and what each run leaves in PostgreSQL (rows and bytes, by table group) and asks
of Redis (commands). Two shapes of run:

* ``answer``: the model answers at once (no tool call): the queue, the run store, the audit
  trail and the lease, with a sandbox started and stopped;
* ``tools``: the shape of ``service_runs.py`` (write a file, read it, answer): two tool calls.

Redis is a private ``redis-server`` started for the benchmark (its command counts are the
benchmark's alone); PostgreSQL is the shared server, each point in a schema of its own (the
table figures are the point's alone; its CPU is every backend's, others' work included).

    python bench/service_capacity.py [--workers 1,2,4] [--runs 200] [--shapes answer,tools]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _service import free_port, percentile, postgres_schema, server, tenants_file, workers

from stockade.client import Client

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(*, comm: str = "", pgid: int | None = None) -> float:
    """CPU seconds of every live process named ``comm``, or of process group ``pgid``."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            head, tail = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)
            stat = tail.split()
            if pgid is not None and int(stat[2]) != pgid:
                continue
            if comm and head.split("(", 1)[1] != comm:
                continue
            total += int(stat[11]) + int(stat[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total / TICKS


@contextlib.contextmanager
def private_redis(folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=(folder / "redis.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        proc.wait(10)


def redis_commands(url: str) -> int:
    import redis

    info: dict[str, object] = redis.Redis.from_url(url).info("stats")  # type: ignore[assignment]
    return int(str(info["total_commands_processed"]))


def table_figures(db: str) -> dict[str, tuple[int, int, int]]:
    """Per group of tables (``runs_``, ``audit_``, ``svc_``): rows, bytes, tuples written."""
    import psycopg

    groups: dict[str, tuple[int, int, int]] = {}
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute(
            b"SELECT relname, n_live_tup, pg_total_relation_size(relid), n_tup_ins + n_tup_upd + n_tup_del "
            b"FROM pg_stat_user_tables WHERE schemaname = current_schema()"
        ).fetchall()
    for name, live, size, written in rows:
        group = str(name).split("_")[0] + ("_t" if str(name).startswith("audit_t_") else "")
        old = groups.get(group, (0, 0, 0))
        groups[group] = (old[0] + int(live), old[1] + int(size), old[2] + int(written))
    return groups


def turns(shape: str, i: int) -> list[object]:
    if shape == "answer":
        return [f"done {i}"]
    return [{"name": "write_file", "args": {"path": f"out/{i}.txt", "content": f"run {i}\n"}},
            {"name": "read_file", "args": {"path": f"out/{i}.txt"}}, f"done {i}"]  # fmt: skip


def point(shape: str, count: int, runs: int, postgres: str, folder: Path) -> None:
    with private_redis(folder) as (redis_url, redis_proc), postgres_schema(postgres) as db:
        tenants, token = tenants_file(folder)
        queue = f"cap{count}{shape}"
        with (
            workers(folder, tenants, db, redis_url, queue, count=count) as pool,
            server(folder, tenants, db, redis=redis_url, queue=queue) as (url, api),
        ):
            client = Client(url, token, timeout_s=300)
            # a run per worker first: each worker's runner and connections are made
            warm = [client.runs.submit(f"warm {i}", scripted=turns(shape, -1 - i)) for i in range(2 * count)]
            for run in warm:
                run.wait(timeout_s=120)
            time.sleep(1.0)
            cpu0 = {
                "workers": sum(cpu_seconds(pgid=p.pid) for p in pool),
                "api": cpu_seconds(pgid=api.pid),
                "postgres": cpu_seconds(comm="postgres"),
                "redis": cpu_seconds(pgid=redis_proc.pid),
            }
            tables0 = table_figures(db)
            commands0 = redis_commands(redis_url)
            submitted: dict[str, float] = {}

            def submit(i: int) -> None:
                run = client.runs.submit(f"cap {i}", scripted=turns(shape, i), labels={"cap": "1"})
                submitted[run.id] = time.time()

            start = time.time()
            with ThreadPoolExecutor(16) as threads:
                list(threads.map(submit, range(runs)))
            done: dict[str, dict[str, object]] = {}
            deadline = time.monotonic() + 3600
            while len(done) < len(submitted) and time.monotonic() < deadline:
                for status in ("success", "error"):
                    for run in client.runs.list(limit=1000, status=status, label="cap=1"):
                        done.setdefault(run.id, run.info)
                time.sleep(0.5)
            end = max(float(str(info["finished_at"])) for info in done.values())
            cpu1 = {
                "workers": sum(cpu_seconds(pgid=p.pid) for p in pool),
                "api": cpu_seconds(pgid=api.pid),
                "postgres": cpu_seconds(comm="postgres"),
                "redis": cpu_seconds(pgid=redis_proc.pid),
            }
            time.sleep(1.0)  # PostgreSQL's table statistics are flushed within a second
            tables1 = table_figures(db)
            commands = redis_commands(redis_url) - commands0
            client.close()
    latencies = [float(str(info["finished_at"])) - submitted[rid] for rid, info in done.items()]
    failed = sum(1 for info in done.values() if info["status"] != "success")
    n = len(done)
    per_run_cpu = ", ".join(f"{k} {1000 * (cpu1[k] - cpu0[k]) / n:.0f} ms" for k in cpu0)
    written = ", ".join(
        f"{g} {(tables1[g][0] - tables0.get(g, (0, 0, 0))[0]) / n:.1f} rows "
        f"{(tables1[g][1] - tables0.get(g, (0, 0, 0))[1]) / n / 1024:.1f} KiB "
        f"{(tables1[g][2] - tables0.get(g, (0, 0, 0))[2]) / n:.1f} writes"
        for g in sorted(tables1)
    )
    print(
        f"{shape:6} workers {count}: {n}/{runs} done ({failed} not success), "
        f"{n / (end - start):.1f} runs/s, submit-to-done p50 {percentile(latencies, 50):.2f} s "
        f"p99 {percentile(latencies, 99):.2f} s",
        flush=True,
    )
    print(f"        CPU per run: {per_run_cpu}; Redis {commands / n:.1f} commands per run", flush=True)
    print(f"        PostgreSQL per run: {written}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--shapes", default="answer,tools")
    parser.add_argument("--postgres", default="postgresql://stockade:stockade@127.0.0.1:5432/stockade")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    for shape in args.shapes.split(","):
        for count in (int(c) for c in args.workers.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                point(shape, count, args.runs, args.postgres, Path(tmp))
    print(f"load average at end: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
