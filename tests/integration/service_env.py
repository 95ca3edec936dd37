"""The service under test: real ``stockade serve`` (uvicorn on 127.0.0.1, a free port) and real
``stockade worker`` processes, on SQLite or on a PostgreSQL schema of the test's own, with a
Redis queue (and key prefix) of its own. Everything is removed afterwards: processes (their
whole process groups), the schema, the Redis keys."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import require, wait_for
from tests.integration.run_stores import POSTGRES_URL, postgres_reachable

if TYPE_CHECKING:
    from stockade.server.runner import Runner

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("STOCKADE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted:*"]
[commands]
approve = ["rm -r"]
[roles.dev]
tiers = ["process"]
[roles.viewer]
tiers = ["process"]
tools = ["read_file", "list_files"]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Tokens:
    acme: str
    acme_viewer: str
    other: str


def write_tenants(
    folder: Path, *, sandboxes: int = 3, memory_mb: int = 2048, runs: int = 50, storage_mb: int = 2048,
    acme_rate: str = "", keep_runs_days: float | None = None, acme_quotas: Mapping[str, int] | None = None,
) -> tuple[Path, Tokens]:  # fmt: skip
    """``acme_rate``: lines of acme's rate limit (``rate_per_minute = 2``, ...), none by default;
    ``keep_runs_days``: acme's retention of the runs that ended (none: kept); ``acme_quotas``:
    more of acme's quotas (``running_calls``, ``bodies_mb``, ...; the rest are the defaults)."""
    from stockade.server.tenants import Tenants, new_token

    (folder / "policy.toml").write_text(POLICY)
    acme, acme_record = new_token("acme", "dev")
    viewer, viewer_record = new_token("acme", "viewer")
    other, other_record = new_token("other", "dev")
    lines = [
        f'[tenants.acme]\npolicy = "policy.toml"\nsandboxes = {sandboxes}\ncpus = 4\n'
        f"memory_mb = {memory_mb}\nruns = {runs}\nstorage_mb = {storage_mb}\n{acme_rate}"
        + (f"keep_runs_days = {keep_runs_days!r}\n" if keep_runs_days is not None else "")
        + "".join(f"{name} = {value}\n" for name, value in (acme_quotas or {}).items()),
        '[tenants.other]\npolicy = "policy.toml"\n',
    ]
    empty = Tenants(tenants={}, tokens={})
    lines += [empty.toml_lines(r) for r in (acme_record, viewer_record, other_record)]
    path = folder / "tenants.toml"
    path.write_text("\n".join(lines))
    Tenants.load(path)
    return path, Tokens(acme=acme, acme_viewer=viewer, other=other)


@contextlib.contextmanager
def runner_on_sqlite(tenants: Path, folder: Path) -> Iterator[Runner]:
    """A service ``Runner`` of this process, on a SQLite database in ``folder``."""
    from stockade.server.context import ServiceConfig
    from stockade.server.runner import Runner
    from stockade.server.tenants import Tenants

    config = ServiceConfig(
        tenants=Tenants.load(tenants), database=f"sqlite:///{folder / 'svc.db'}", temp_dir=folder
    )
    made = Runner(config)
    try:
        yield made
    finally:
        made.close()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


class Process:
    """A child in a process group of its own: stopped with SIGTERM, then SIGKILL, whole."""

    def __init__(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ):
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stockade.cli.main", *argv], stdout=self._out, stderr=subprocess.STDOUT,
            env=_env(env), cwd=cwd, start_new_session=True,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # to the service, as a supervisor would
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill_group(signal.SIGKILL)  # what is left of the group (a pool's children)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Server(Process):
    def __init__(self, tenants: Path, db: str, folder: Path, *, redis: str | None = None,
                 queue: str = "stockade", extra: list[str] | None = None,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "--tenants", str(tenants), "--db", db, "--port", str(self.port), "--queue", queue]
        if redis:
            argv += ["--redis", redis]  # the broker's visibility timeout as shipped (an hour)
        super().__init__([*argv, *(extra or [])], folder / f"server-{self.port}.log", env=env, cwd=folder)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        import httpx2

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.output()[-3000:]}")
            try:
                return httpx2.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx2.TransportError:
                return False

        wait_for(
            healthy,
            what=lambda: f"the server to start: {self.output()[-3000:]}",
            timeout_s=timeout_s,
            interval_s=0.1,
        )


class Worker(Process):
    def __init__(self, tenants: Path, db: str, redis: str, queue: str, folder: Path, name: str,
                 tools: str | None = None, env: dict[str, str] | None = None,
                 extra: list[str] | None = None):  # fmt: skip
        argv = ["worker", "--tenants", str(tenants), "--db", db, "--redis", redis, "--queue", queue,
                "--concurrency", "1", "--name", f"{name}@{queue}"]  # fmt: skip
        if tools:
            argv += ["--tools", tools]
        argv += extra or []
        super().__init__(argv, folder / f"worker-{name}.log", env=env, cwd=folder)


@contextlib.contextmanager
def embedded_server(
    folder: Path, *, storage_mb: int, acme_quotas: Mapping[str, int] | None = None
) -> Iterator[tuple[Server, Tokens, Path]]:
    """``stockade serve`` on SQLite in ``folder``, for a module's tests; it must stop cleanly."""
    tenants, tokens = write_tenants(folder, storage_mb=storage_mb, acme_quotas=acme_quotas)
    server = Server(tenants, f"sqlite:///{folder / 'service.db'}", folder)
    try:
        yield server, tokens, folder
    finally:
        server.stop()
    # uvicorn stops cleanly on SIGTERM, then re-raises it (exit by the signal)
    assert server.proc.returncode in (0, -15), server.output()[-3000:]
    assert "Traceback" not in server.output(), server.output()[-3000:]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL whose tables land in a schema of this test's own (dropped afterwards)."""
    with postgres_schema() as url:
        yield url


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL URL whose tables land in a schema of its own, dropped on leaving (for a
    fixture of a wider scope than ``postgres_url``'s)."""
    ok, why = postgres_reachable()
    require("postgres", ok, why)
    import psycopg

    schema = f"svc_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}".encode())
    sep = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE".encode())


@pytest.fixture
def redis_queue() -> Iterator[str]:
    """A Celery queue name (and Redis key prefix) of this test's own; its keys are deleted after."""
    try:
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
        client.ping()
        ok, why = True, ""
    except Exception as error:
        ok, why = False, f"{REDIS_URL}: {error}"
    require("redis", ok, why)
    queue = f"stockade_test_{uuid.uuid4().hex[:10]}"
    try:
        yield queue
    finally:
        for pattern in (f"{queue}*", f"*{queue}*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)
        client.close()
