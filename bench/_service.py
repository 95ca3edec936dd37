"""Starting the service for the benchmarks: ``stockade serve`` and ``stockade worker`` as
subprocesses on 127.0.0.1, a tenants file with generous quotas, a PostgreSQL schema and a
Redis prefix of their own (all removed at the end)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2

from stockade.server.tenants import Tenants, new_token

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tenants_file(folder: Path) -> tuple[Path, str]:
    """One tenant without a quota the benchmarks would meet (its calls at once included: the
    load is the point)."""
    token, record = new_token("bench")
    (folder / "policy.toml").write_text('version = 1\n[trust]\nlevel = "trusted"\n')
    text = (
        '[tenants.bench]\npolicy = "policy.toml"\nsandboxes = 1000\ncpus = 10000\nmemory_mb = 10000000\n'
        "runs = 100000\nrunning_calls = 10000\n\n" + Tenants(tenants={}, tokens={}).toml_lines(record)
    )
    (folder / "tenants.toml").write_text(text)
    return folder / "tenants.toml", token


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "stockade.cli.main", *argv]
    return subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=log.parent,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def server(folder: Path, tenants: Path, db: str, *, redis: str | None = None, queue: str = "stockade",
           threads: int = 2) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:  # fmt: skip
    port = free_port()
    argv = ["serve", "--tenants", str(tenants), "--db", db, "--port", str(port), "--queue", queue,
            "--run-threads", str(threads)]  # fmt: skip
    if redis:
        argv += ["--redis", redis]
    proc = _spawn(argv, folder / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx2.TransportError):
                if httpx2.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError((folder / "server.log").read_text()[-2000:])
            time.sleep(0.1)
        yield url, proc
    finally:
        stop(proc)


@contextlib.contextmanager
def workers(folder: Path, tenants: Path, db: str, redis: str, queue: str, *, count: int,
            concurrency: int = 1) -> Iterator[list[subprocess.Popen[bytes]]]:  # fmt: skip
    procs = [
        _spawn(["worker", "--tenants", str(tenants), "--db", db, "--redis", redis, "--queue", queue,
                "--concurrency", str(concurrency), "--name", f"w{i}@{queue}"], folder / f"worker{i}.log")
        for i in range(count)
    ]  # fmt: skip
    try:
        yield procs
    finally:
        for proc in procs:
            stop(proc)


@contextlib.contextmanager
def postgres_schema(url: str) -> Iterator[str]:
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}".encode())
    try:
        yield f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE".encode())


@contextlib.contextmanager
def redis_prefix(url: str) -> Iterator[str]:
    import redis

    queue = f"stockade_bench_{uuid.uuid4().hex[:8]}"
    try:
        yield queue
    finally:
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=f"*{queue}*", count=1000))
        if keys:
            client.delete(*keys)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0
