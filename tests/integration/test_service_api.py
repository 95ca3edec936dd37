"""``stockade serve`` embedded (SQLite, runs in the server's process), through real HTTP and the
Python client: sandboxes, runs, tenants, quotas, and bad input answered with a clear 4xx."""

from __future__ import annotations

import gzip
import io
import json
import os
import socket
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from typer.testing import CliRunner

from stockade import Limits, NetworkPolicy
from stockade import exceptions as exc
from stockade.cli.main import app
from stockade.client import Client, RemoteSandbox
from stockade.sandbox.process import ProcessBackend
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Mechanism
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server, Tokens, embedded_server, write_tenants

pytestmark = [pytest.mark.process]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path]]:
    require_tier("process")
    with embedded_server(tmp_path_factory.mktemp("service"), storage_mb=1) as running:
        yield running


@pytest.fixture
def acme(service: tuple[Server, Tokens, Path]) -> Iterator[Client]:
    server, tokens, _ = service
    with Client(server.url, tokens.acme) as client:
        yield client


def raw(service: tuple[Server, Tokens, Path], token: str | None = None) -> httpx2.Client:
    server, tokens, _ = service
    headers = {"Authorization": f"Bearer {token if token is not None else tokens.acme}"}
    return httpx2.Client(base_url=server.url, headers=headers, timeout=60)


def tar_of(members: list[tarfile.TarInfo], contents: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:  # fmt: skip
        for info in members:
            data = (contents or {}).get(info.name, b"")
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


# -- sandboxes -------------------------------------------------------------------------------


def test_a_remote_sandbox_is_a_sandbox(acme: Client, tmp_path: Path) -> None:
    with RemoteSandbox.create(tier="process", limits=Limits(memory_mb=256, timeout_s=20), client=acme) as sbx:
        assert sbx.tier == "process" and sbx.alive
        chunks: list[tuple[float, str]] = []
        result = sbx.commands.run(
            "for i in 1 2 3; do echo $i; sleep 0.3; done; echo oops >&2; exit 3",
            on_stdout=lambda text: chunks.append((time.monotonic(), text)),
        )
        assert result.exit_code == 3 and result.stdout == "1\n2\n3\n" and result.stderr == "oops\n"
        assert "".join(t for _, t in chunks) == "1\n2\n3\n"
        assert chunks[-1][0] - chunks[0][0] > 0.4  # streamed while it ran, not at the end
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"  # state persists between calls
        assert sbx.run_code("echo 42", "bash").logs.stdout == "42\n"
        sbx.files.write("src/a.py", "print('hi')\n")
        assert sbx.files.read("src/a.py") == "print('hi')\n"
        assert sbx.files.read_range("src/a.py", 6, 4) == b"'hi'"  # the service reads only that
        assert [e.name for e in sbx.files.list("src")] == ["a.py"]
        assert sbx.files.exists("src/a.py") and not sbx.files.exists("nope")
        (tmp_path / "up" / "d").mkdir(parents=True)
        (tmp_path / "up" / "d" / "f.txt").write_text("data")
        sbx.files.upload_dir(tmp_path / "up", "up")
        got = sbx.files.download_dir(tmp_path / "down", "up")
        assert got.files == 1 and (tmp_path / "down" / "d" / "f.txt").read_text() == "data"
        sbx.files.remove("src/a.py")
        with pytest.raises(exc.SandboxFileNotFound):
            sbx.files.read("src/a.py")
        with pytest.raises(exc.PathEscapeError) as escaped:
            sbx.files.write("../outside.txt", "x")
        assert escaped.value.path == "../outside.txt"
    with pytest.raises(exc.ResourceNotFound):
        acme.http.request("GET", f"/v1/sandboxes/{sbx.id}")


def test_a_listing_cut_at_its_cap_says_so_through_the_service(acme: Client) -> None:
    limits = Limits(memory_mb=1536, inodes=110_000, timeout_s=60)
    with RemoteSandbox.create(tier="process", limits=limits, client=acme) as sbx:
        made = sbx.commands.run("mkdir many && cd many && seq 1 100001 | xargs touch", timeout_s=60)
        assert made.exit_code == 0, made.stderr
        cut = sbx.files.list("many")
        assert len(cut) == 100_000 and cut.truncated  # the header carried it to the client
        assert not sbx.files.list("").truncated


def test_what_the_local_sdk_takes_goes_over_real_http_and_mistakes_fail_before_it(acme: Client) -> None:
    with RemoteSandbox.create(tier="process", client=acme) as sbx:
        sbx.files.write("b.bin", bytearray(b"\x00\xffab"))  # type: ignore[arg-type]  # as the local SDK takes
        assert sbx.files.read("b.bin", format="bytes") == b"\x00\xffab"
        assert sbx.commands.run("cat", stdin=memoryview(b"caf\xc3\xa9")).stdout == "café"  # type: ignore[arg-type]
        with pytest.raises(exc.InvalidArgument, match="surrogate"):
            sbx.files.write("\udc80", "x")
        with pytest.raises(exc.InvalidArgument, match="timeout_s"):
            sbx.commands.run("true", timeout_s=float("nan"))
        assert sbx.commands.run("echo still here").stdout == "still here\n"


def test_a_killed_sandbox_stops_mid_command(acme: Client) -> None:
    import threading

    sbx = RemoteSandbox.create(tier="process", client=acme)
    failure: list[BaseException] = []

    def long_command() -> None:
        try:
            sbx.commands.run("sleep 30")
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=long_command)
    thread.start()
    time.sleep(1.0)
    started = time.monotonic()
    sbx.kill()
    thread.join(15)
    assert time.monotonic() - started < 10 and failure
    assert isinstance(failure[0], exc.SandboxError), failure
    assert not sbx.alive
    sbx.close()


def test_another_tenant_sees_nothing_and_gets_404(service: tuple[Server, Tokens, Path], acme: Client) -> None:
    server, tokens, _ = service
    with RemoteSandbox.create(tier="process", client=acme) as sbx, Client(server.url, tokens.other) as other:
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/kill"), ("GET", "/files")):
            with pytest.raises(exc.ResourceNotFound):
                other.http.request(method, f"/v1/sandboxes/{sbx.id}{path}")
        assert other.sandboxes() == []
        run = acme.runs.submit("noop", scripted=["done"])
        with pytest.raises(exc.ResourceNotFound):
            other.runs.get(run.id)
        with pytest.raises(exc.ResourceNotFound):
            other.http.request("POST", f"/v1/runs/{run.id}/kill", json={})
        assert all(r.id != run.id for r in other.runs.list())
        assert sbx.alive and run.wait().status == "success"


def test_the_role_is_asked_before_anything_runs(service: tuple[Server, Tokens, Path]) -> None:
    with raw(service) as http:
        refused = http.post("/v1/sandboxes", json={"tier": "docker"})
        assert refused.status_code == 403
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["error"] == "PolicyDenied" and "process" in refused.json()["detail"]
        network = http.post("/v1/sandboxes", json={"tier": "process", "network": {"enabled": True}})
        assert network.status_code == 403 and network.json()["rule"] == "network.enabled"
        hosts = http.post("/v1/sandboxes", json={"tier": "process", "network": {"allow_hosts": ["a.test"]}})
        assert hosts.status_code == 403 and hosts.json()["rule"] == "network.enabled"  # a way out too
        model = http.post("/v1/runs", json={"task": "x", "model": "openai:gpt-4.1"})
        assert model.status_code in (403, 422), model.text  # not approved (or no SDK): never queued
    server, _, _ = service
    with Client(server.url, service[1].acme_viewer) as viewer:
        write = {"name": "write_file", "args": {"path": "a", "content": "x"}}
        run = viewer.runs.submit("write", scripted=[write, "done"])
        run.wait()
        assert run.diff() == ""  # the viewer's role has no write_file: denied, nothing written


def test_quotas_hold(service: tuple[Server, Tokens, Path], acme: Client) -> None:
    held = [RemoteSandbox.create(tier="process", limits=Limits(memory_mb=256), client=acme) for _ in range(3)]
    try:
        with pytest.raises(exc.QuotaExceeded) as full:
            RemoteSandbox.create(tier="process", limits=Limits(memory_mb=256), client=acme)
        assert full.value.quota == "sandboxes"
    finally:
        for sbx in held:
            sbx.close()
    with pytest.raises(exc.QuotaExceeded) as memory:
        RemoteSandbox.create(tier="process", limits=Limits(memory_mb=4096), client=acme)
    assert memory.value.quota == "memory_mb"
    RemoteSandbox.create(tier="process", client=acme).close()  # freed


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input_gets_a_clear_4xx_and_the_audit_trail_still_verifies(
    service: tuple[Server, Tokens, Path], acme: Client, tmp_path: Path
) -> None:
    server, _, folder = service
    before = sorted(p.name for p in folder.iterdir())
    with RemoteSandbox.create(tier="process", client=acme) as sbx, raw(service) as http:
        base = f"/v1/sandboxes/{sbx.id}"
        cases: list[tuple[httpx2.Response, int, str]] = [
            (http.post("/v1/sandboxes", content=b'{"tier": ', headers={"Content-Type": "application/json"}),
             400, "body"),
            (http.post("/v1/runs", content=b'{"task": "t", "scripted": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                       headers={"Content-Type": "application/json"}), 400, "body"),
            (http.post("/v1/sandboxes", json={"tier": "process", "colour": "red"}), 422, "colour"),
            (http.post("/v1/sandboxes", json={"limits": {"memory_mb": 1}}), 422, "Limits.memory_mb"),
            (http.post("/v1/sandboxes", json={"limits": {"memory_mb": 10**400}}), 422, "Limits.memory_mb"),
            (http.post("/v1/runs", json={"task": "t", "scripted": [], "sandbox_limits": {"pids": 10**400}}),
             422, "Limits.pids"),
            (http.post("/v1/runs", json={"task": ""}), 422, "task"),
            (http.post("/v1/runs", json={"task": "t", "check_timeout_s": 1e308}), 422, "check_timeout_s"),
            (http.put(f"{base}/archive", content=tar_of([member("../evil.txt")], {"../evil.txt": b"x"})),
             422, ""),
            (http.put(f"{base}/archive", content=tar_of([member("link", tarfile.SYMTYPE, "/etc/passwd")])),
             422, ""),
            (http.put(f"{base}/archive", content=tar_of([member("a/../../b", tarfile.SYMTYPE, "x")])),
             422, ""),
            (http.put(f"{base}/archive", content=tar_of([member("name-\udcff.txt")])), 422, "body"),
            (http.put(f"{base}/archive", content=b"not a tar at all" * 10), 422, "body"),
            (http.post("/v1/workspaces", content=tar_of([member("up/../../x")])), 422, ""),
            (http.put(f"{base}/files/content", params={"path": "big"}, content=b"x" * (64 * 1024 * 1024 + 1)),
             413, ""),
            (http.post("/v1/workspaces", content=gzip.compress(b"not a tar, gzipped")), 422, "body"),
        ]  # fmt: skip
        for response, status, field in cases:
            assert response.status_code == status, (response.request.url, response.text)
            body = response.json()
            assert response.headers["content-type"] == "application/problem+json"
            assert body["status"] == status and body["detail"] and body["type"].startswith("/problems/")
            if field:
                assert body["field"] == field, body
            if status == 422 and "archive" in str(response.request.url):
                assert body["fix"] or body["error"] in ("PathEscapeError",), body
        assert sbx.files.list("") == []  # nothing of it reached the workspace
        for headers in ({}, {"Authorization": "Bearer stk_000000000000_wrongwrongwrongwrongwrong"},
                        {"Authorization": "Basic abc"}):  # fmt: skip
            anonymous = httpx2.get(server.url + "/v1/sandboxes", headers=headers)
            assert anonymous.status_code == 401 and anonymous.json()["error"] == "AuthenticationError"
            assert anonymous.headers["www-authenticate"].startswith("Bearer")
        assert http.get("/v1/nothing").status_code == 404
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing new beside the service's files
    assert not Path("/evil.txt").exists() and not (folder.parent / "evil.txt").exists()
    report = acme.verify_audit()
    assert report["ok"], report


def test_openapi_is_generated(service: tuple[Server, Tokens, Path]) -> None:
    server, _, _ = service
    spec = httpx2.get(server.url + "/openapi.json").json()
    assert {"/v1/sandboxes", "/v1/runs", "/v1/runs/{run_id}/events"} <= set(spec["paths"])
    problem = httpx2.get(server.url + "/problems/path-escape").json()
    assert problem["status"] == 422 and problem["error"] == "PathEscapeError"


# -- runs -------------------------------------------------------------------------------------


def test_a_run_is_submitted_followed_and_its_diff_and_artifacts_fetched(acme: Client, tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "app.py").write_text("print('v1')\n")
    turns = [
        {"name": "read_file", "args": {"path": "app.py"}},
        {"name": "write_file", "args": {"path": "app.py", "content": "print('v2')\n"}},
        "updated app.py",
    ]
    run = acme.runs.submit("update app.py", scripted=turns, workspace=tmp_path / "project",
                           labels={"team": "core"}, idempotency_key="update-1")  # fmt: skip
    again = acme.runs.submit("update app.py", scripted=turns, workspace=tmp_path / "project",
                             labels={"team": "core"}, idempotency_key="update-1")  # fmt: skip
    assert again.id == run.id  # the same submission twice is one run
    kinds = [event.kind for event in run.events()]
    assert kinds[0] == "status" and kinds[-1] == "end"
    assert {"run_start", "model_call", "tool_call", "run_end"} <= set(kinds)
    done = run.wait()
    assert done.status == "success" and done.info["answer"] == "updated app.py" and done.info["steps"] == 3
    assert "-print('v1')" in run.diff() and "+print('v2')" in run.diff()
    assert (run.artifacts(tmp_path / "out") / "app.py").read_text() == "print('v2')\n"
    assert [r.id for r in acme.runs.list(label="team=core")] == [run.id]
    assert (tmp_path / "project" / "app.py").read_text() == "print('v1')\n"  # the upload was copied
    with pytest.raises(exc.RunConflict):
        acme.runs.submit("another task", scripted=["done"], idempotency_key="update-1")


def test_each_tenants_trail_verifies_against_its_own_runs_only(service: tuple[Server, Tokens, Path]) -> None:
    """One run store holds every tenant's runs and each tenant's trail is a chain of its own:
    `stockade audit verify` checked a tenant's chain against every tenant's tool calls (a
    not_in_trail for each of the others': a tamper alarm on a healthy service), and the API
    checked no ledger at all."""
    server, tokens, folder = service
    turns = [{"name": "write_file", "args": {"path": "a.txt", "content": "x"}}, "wrote a.txt"]
    for token in (tokens.acme, tokens.other):
        with Client(server.url, token) as client:
            assert client.runs.submit("write a.txt", scripted=turns).wait().status == "success"
            assert client.verify_audit()["ok"], client.verify_audit()
    db = f"sqlite:///{folder / 'service.db'}"
    for tenant in ("acme", "other"):
        for how in (["--tenant", tenant], ["--namespace", f"audit_t_{tenant}"]):
            verified = CliRunner().invoke(app, ["audit", "verify", "--db", db, "--json", *how])
            report = json.loads(verified.stdout)
            assert verified.exit_code == 0 and report["ledger"] and not report["problems"], verified.output
    nothing = CliRunner().invoke(
        app, ["audit", "verify", "--db", str(folder / "nothing.db"), "--tenant", "acme"]
    )
    assert nothing.exit_code == 2


def test_an_event_stream_resumes_from_any_position_a_client_sends(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    run = acme.runs.submit("answer", scripted=["done"])
    assert run.wait().status == "success"
    with raw(service) as http:
        whole = http.get(f"/v1/runs/{run.id}/events").text
        for header in (b"\xb2", b"9" * 40, b"-1", b"abc"):  # not a position: from the start
            again = http.get(f"/v1/runs/{run.id}/events", headers={b"Last-Event-ID": header})
            assert again.status_code == 200 and again.text.count("event: ") == whole.count("event: "), header
        past = http.get(f"/v1/runs/{run.id}/events", params={"after": 10**30})
    assert past.status_code == 422 and past.json()["field"] == "after", past.text


def test_a_pending_approval_pauses_the_run_until_decided(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    turns = [
        {"name": "write_file", "args": {"path": "d/f.txt", "content": "x"}},
        {"name": "run_code", "args": {"code": "echo kept-in-tmp > /tmp/mark", "language": "bash"}},
        {"name": "run_code", "args": {"code": "rm -r d", "language": "bash"}},
        {"name": "run_code", "args": {"code": "cat /tmp/mark", "language": "bash"}},
        "removed",
    ]
    run = acme.runs.submit("clean up", scripted=turns)
    assert run.wait().status == "paused"
    [request] = run.refresh().info["pending_approvals"]
    assert "rm -r" in request["action"]
    events = [e.kind for e in run.events()]
    assert "approval" in events and events[-1] == "end"
    # the paused run's sandbox is kept in the tenant's own snapshot store (its snapshot_mb)
    tenant_store = SnapshotStore(service[2] / "snapshots" / "acme")
    assert tenant_store.ref("run", run.id) is not None
    run.approve(request["id"])
    done = run.wait()
    assert done.status == "success"
    assert [a["status"] for a in run.approvals()] == ["spent"]  # the yes let its action go, once
    with pytest.raises(exc.RunConflict, match="ended"):  # nothing of the run acts on a decision now
        run.approve(request["id"])
    # resumed from it (its /tmp, which the run store does not keep, came back with it), then released
    commands = {
        e.data["attributes"]["program"]: e.data["attributes"] for e in run.events() if e.kind == "command"
    }
    wrote, read = commands["echo kept-in-tmp > /tmp/mark"], commands["cat /tmp/mark"]
    assert read["sandbox_id"] != wrote["sandbox_id"]  # another sandbox, started from the kept one
    assert read["exit_code"] == 0 and read["stdout_bytes"] == len("kept-in-tmp\n")
    assert tenant_store.ref("run", run.id) is None


def test_a_paused_run_killed_then_deleted_leaves_nothing_in_its_tenants_store(
    service: tuple[Server, Tokens, Path], acme: Client
) -> None:
    """Its kept sandbox (listed nowhere, counted against snapshot_mb) goes with the run: before,
    killed and deleted, its objects stayed for good and no one could delete them."""
    turns = [
        {"name": "run_code", "args": {"code": "head -c 4000000 /dev/urandom > big.bin", "language": "bash"}},
        {"name": "run_code", "args": {"code": "mkdir -p d && rm -r d", "language": "bash"}},
        "done",
    ]
    run = acme.runs.submit("make and clean", scripted=turns)
    assert run.wait().status == "paused"
    tenant_store = SnapshotStore(service[2] / "snapshots" / "acme")
    ref = tenant_store.ref("run", run.id)
    assert ref is not None
    snapshot = tenant_store.load(ref["snapshot"])
    objects = [tenant_store.object_path(digest) for digest in snapshot.blobs.values()]
    assert any(path.exists() for path in objects)
    assert run.kill("no").status == "killed"
    assert tenant_store.ref("run", run.id) is None
    assert not any(path.exists() for path in objects)  # its bytes given back at once
    run.delete()
    assert tenant_store.ref("run", run.id) is None


def test_a_yes_to_an_exec_shown_masked_is_spent_by_that_exec_alone(acme: Client, tmp_path: Path) -> None:
    """Code removes `keep_token=SHOWN1234`: the request shows its value masked, and it is
    approved. Code then removes `keep_token=OTHER5678`, shown alike: it had the same request id,
    spent the yes, and its folder went while the one approved stayed (found from outside)."""
    project = tmp_path / "project"
    for name, text in (
        ("keep_token=SHOWN1234", "approved folder\n"),
        ("keep_token=OTHER5678", "other folder\n"),
    ):
        (project / name).mkdir(parents=True)
        (project / name / "f.txt").write_text(text)

    def removal(name: str) -> dict[str, object]:
        code = f"import subprocess; subprocess.run(['rm', '-r', {name!r}])"
        return {"name": "run_code", "args": {"code": code, "language": "python"}}

    turns = [
        removal("keep_token=SHOWN1234"),  # refused on the spot, asked about
        {"name": "run_code", "args": {"code": "mkdir -p d && rm -r d", "language": "bash"}},  # pauses
        removal("keep_token=OTHER5678"),
        removal("keep_token=SHOWN1234"),
        "done",
    ]
    run = acme.runs.submit("clean up", scripted=turns, workspace=project)
    assert run.wait().status == "paused"
    # oldest first: the yes to the pause resumes the run, which may end before a later approve
    for request in reversed(run.refresh().info["pending_approvals"]):
        run.approve(request["id"])
    assert run.wait().status == "success"
    diff = run.diff()
    assert "-approved folder" in diff and "-other folder" not in diff
    removals = [a for a in run.approvals() if "keep_token" in a["action"]]
    other, shown = sorted(removals, key=lambda a: a["status"])
    assert (shown["status"], other["status"]) == ("spent", "denied")  # the other, withdrawn at the end
    assert shown["action"] == other["action"] and shown["id"] != other["id"]


def test_a_run_is_killed_through_the_api(acme: Client) -> None:
    sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
    run = acme.runs.submit("sleep", scripted=[sleep, "never"])
    wait_for(lambda: run.refresh().status == "running", what="the run to start", timeout_s=30, interval_s=0.1)
    time.sleep(1.0)
    started = time.monotonic()
    run.kill("enough")
    assert run.wait(timeout_s=30).status == "killed"
    assert time.monotonic() - started < 15
    assert any(e.kind == "kill_switch" for e in run.events())


def test_a_runs_sandbox_holds_its_share_of_the_tenants_quota(acme: Client) -> None:
    """acme may hold 3 sandboxes and 2048 MB: a run's sandbox is one of them while it runs, and
    a run with no room waits queued (no thread held) until one is freed."""
    with pytest.raises(exc.QuotaExceeded) as never:
        acme.runs.submit("big", scripted=["done"], sandbox_limits=Limits(memory_mb=4096))
    assert never.value.quota == "memory_mb" and "whole quota" in str(never.value)
    small = Limits(memory_mb=256)
    held = [RemoteSandbox.create(tier="process", limits=small, client=acme) for _ in range(2)]
    try:
        sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
        running = acme.runs.submit("sleep", scripted=[sleep, "never"], sandbox_limits=small)
        wait_for(lambda: running.refresh().status == "running", what="the run to start", timeout_s=30)
        with pytest.raises(exc.QuotaExceeded) as full:  # 2 sandboxes and the run's: 3
            RemoteSandbox.create(tier="process", limits=small, client=acme)
        assert full.value.quota == "sandboxes" and "running runs" in str(full.value)
        running.kill("enough")
        assert running.wait(timeout_s=30).status == "killed"
        held.append(RemoteSandbox.create(tier="process", limits=small, client=acme))  # its share is back
        waiting = acme.runs.submit("after", scripted=["done"], sandbox_limits=small)
        wait_for(lambda: "quota" in (waiting.refresh().info.get("error") or ""), what="the run to wait",
                 timeout_s=30)  # fmt: skip
        assert waiting.refresh().status == "queued"
        held.pop().close()
        assert waiting.wait(timeout_s=60).status == "success"
    finally:
        for sbx in held:
            sbx.close()


def test_uploaded_workspaces_and_kept_artifacts_fill_a_storage_quota(
    service: tuple[Server, Tokens, Path], acme: Client, tmp_path: Path
) -> None:
    """acme keeps at most 1 MiB of workspaces, runs and run artifacts in the service's database."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        (folder / "data.bin").write_bytes(os.urandom(600 * 1024))  # does not compress
    kept = acme.runs.upload_workspace(first)
    assert acme.runs.upload_workspace(first) == kept  # the same upload again costs nothing
    with pytest.raises(exc.QuotaExceeded) as full:
        acme.runs.upload_workspace(second)
    assert full.value.quota == "storage_mb" and "DELETE /v1/workspaces/ID" in str(full.value)
    assert kept in [w["id"] for w in acme.workspaces()]
    first_step = {"name": "list_files", "args": {}}
    sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
    run = acme.runs.submit("sleep", scripted=[first_step, sleep, "never"], workspace=kept)
    # past its first step, its checkpoint holds the files it started from ("running" alone
    # may be a kill away from a session that never wrote one)
    wait_for(
        lambda: run.refresh().info["steps"] >= 1, what="the run's first step", timeout_s=30, interval_s=0.1
    )
    with pytest.raises(exc.RunConflict):  # it starts (and would resume) from it
        acme.delete_workspace(kept)
    run.kill("enough")
    assert run.wait(timeout_s=30).status == "killed"
    with pytest.raises(exc.ResourceNotFound):  # 600 KiB more did not fit: not kept
        run.artifacts(tmp_path / "out")
    with Client(service[0].url, service[1].other) as other, pytest.raises(exc.ResourceNotFound):
        other.delete_workspace(kept)
    acme.delete_workspace(kept)
    assert kept not in [w["id"] for w in acme.workspaces()]
    with pytest.raises(exc.QuotaExceeded):  # the run keeps the files it started from in the run store
        acme.runs.upload_workspace(second)
    run.delete()
    acme.delete_workspace(acme.runs.upload_workspace(second))  # room again


def test_runs_go_on_after_the_server_restarts(tmp_path: Path) -> None:
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    db = f"sqlite:///{tmp_path / 'service.db'}"
    server = Server(tenants, db, tmp_path)
    try:
        with Client(server.url, tokens.acme) as client:
            run = client.runs.submit("slow", scripted=[
                {"name": "write_file", "args": {"path": "a.txt", "content": "a"}},
                {"name": "run_code", "args": {"code": "import time; time.sleep(4)", "language": "python"}},
                "done"])  # fmt: skip
            wait_for(
                lambda: run.refresh().info["steps"] >= 1,
                what="the run's first step",
                timeout_s=30,
                interval_s=0.1,
            )
            time.sleep(1.0)
    finally:
        server.stop()  # SIGTERM: the run in progress ends "interrupted", resumable
    server = Server(tenants, db, tmp_path)
    try:
        with Client(server.url, tokens.acme) as client:
            done = client.runs.get(run.id).wait(timeout_s=60)
            assert done.status == "success" and done.info["attempts"] == 2, done.info["error"]
            assert "+a" in done.diff()
            assert client.verify_audit()["ok"]
    finally:
        server.stop()


def test_approving_paused_runs_queues_none_past_the_runs_quota(tmp_path: Path) -> None:
    """A paused run holds no place of the runs quota; decided, it goes back to the queue and
    takes one: approving one paused run after another queued any number of them past the
    quota (found from outside: 6 active runs on a quota of 2). A decision that would pass it
    is refused (429, nothing recorded) until a place is free."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path, runs=1)
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    remove = {"name": "run_code", "args": {"code": "mkdir -p d && rm -r d", "language": "bash"}}
    sleep = {"name": "run_code", "args": {"code": "import time; time.sleep(60)", "language": "python"}}
    try:
        with Client(server.url, tokens.acme) as acme:
            paused = acme.runs.submit("clean up", scripted=[remove, "done"])
            assert paused.wait().status == "paused"
            busy = acme.runs.submit("sleep", scripted=[sleep, "done"])  # the one place
            wait_for(lambda: busy.refresh().status == "running", what="the run to start", timeout_s=30)
            [request] = paused.refresh().info["pending_approvals"]
            with pytest.raises(exc.QuotaExceeded) as full:
                paused.approve(request["id"])
            assert full.value.quota == "runs"
            assert paused.refresh().status == "paused" and paused.info["pending_approvals"]  # nothing decided
            busy.kill("room")
            assert busy.wait(timeout_s=30).status == "killed"
            paused.approve(request["id"])
            assert paused.wait(timeout_s=60).status == "success"
    finally:
        server.stop()


def test_a_tenant_never_gets_the_service_hosts_network(tmp_path: Path) -> None:
    """A policy that grants the whole network means the internet: on the process tier it is
    given walled only (its own namespace, slirp4netns behind the host's firewall: root,
    iptables and slirp4netns); unwalled it would be the service host's own stack (its Redis,
    its PostgreSQL, its API port, its abstract sockets), refused whatever allow_weaker."""
    require_tier("process")
    tenants, tokens = _whole_network(tmp_path)
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    walled = ProcessBackend().unwalled is None
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with Client(server.url, tokens.acme) as client:
            if walled:
                with RemoteSandbox.create(
                    tier="process", network=NetworkPolicy(enabled=True), client=client
                ) as sbx:
                    assert sbx.enforcement.network is Mechanism.FIREWALL and not sbx.enforcement.weakened
                    port = listener.getsockname()[1]
                    reached = sbx.run_code(f"import socket; socket.create_connection(('127.0.0.1', {port}))")
                    assert reached.error is not None and reached.error.name == "ConnectionRefusedError"
            else:
                with pytest.raises(exc.LimitNotEnforceable, match="docker") as refused:
                    RemoteSandbox.create(
                        tier="process", network=NetworkPolicy(enabled=True), allow_weaker=True, client=client
                    )
                assert refused.value.setting == "network"
                assert client.sandboxes() == []
            with RemoteSandbox.create(
                tier="process", allow_weaker=True, client=client
            ) as sbx:  # no network: given
                assert sbx.alive
    finally:
        listener.close()
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def _whole_network(folder: Path, tiers: str = '"process"') -> tuple[Path, Tokens]:
    """Tenants whose policy grants the whole network, on ``tiers``; acme may accept weaker
    enforcement (the operator's consent does not give the service host's network either)."""
    tenants, tokens = write_tenants(folder)
    tenants.write_text(
        tenants.read_text().replace("[tenants.acme]\n", "[tenants.acme]\nallow_weaker = true\n", 1)
    )
    policy = (folder / "policy.toml").read_text().replace('tiers = ["process"]', f"tiers = [{tiers}]")
    (folder / "policy.toml").write_text(policy.replace("[models]", "[network]\nenabled = true\n[models]"))
    return tenants, tokens


def test_a_tenant_weakens_a_sandbox_only_where_the_tenants_file_lets_it(tmp_path: Path) -> None:
    """The policy's write rule is a pattern (``src/*.py``) no kernel holds as a path: with
    allow_weaker the sandbox judges it on tool calls only. The request asks; the operator's
    tenants file decides: other's entry allows it, acme's says nothing, so acme is refused
    with the setting to change, and nothing of its sandbox is left."""
    require_tier("process")
    tenants, tokens = write_tenants(tmp_path)
    policy = (tmp_path / "policy.toml").read_text()
    (tmp_path / "policy.toml").write_text(
        policy.replace("[models]", '[paths]\nwrite = ["src/*.py"]\n[models]')
    )
    tenants.write_text(
        tenants.read_text().replace("[tenants.other]\n", "[tenants.other]\nallow_weaker = true\n", 1)
    )
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        with Client(server.url, tokens.acme) as acme, Client(server.url, tokens.other) as other:
            with pytest.raises(
                exc.PolicyDenied, match=r"allow_weaker = true under \[tenants.acme\]"
            ) as refused:
                RemoteSandbox.create(tier="process", allow_weaker=True, client=acme)
            assert refused.value.rule == "tenants.acme.allow_weaker" and "paths.write" in str(refused.value)
            # unasked, the tier's own advice to pass allow_weaker says where it counts here
            with pytest.raises(exc.LimitNotEnforceable, match="pattern") as unasked:
                RemoteSandbox.create(tier="process", client=acme)
            assert unasked.value.setting == "paths.write"
            assert "allow_weaker = true under [tenants.acme]" in unasked.value.fix
            assert acme.sandboxes() == []
            with RemoteSandbox.create(tier="process", allow_weaker=True, client=other) as sbx:
                assert any(w.startswith("paths.write") for w in sbx.info["enforcement"]["weakened"])
                assert sbx.commands.run("echo fine").stdout == "fine\n"
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_an_allowlist_narrowed_from_the_whole_network_never_names_the_service_hosts_addresses(
    tmp_path: Path,
) -> None:
    """The whole network is the public internet; the egress proxy that serves an allowlist
    connects from the service host, so an IP literal that is not public (the host's loopback,
    the cloud metadata service, a private address) is refused unless the operator's policy
    names it in allow_addresses. A name is the proxy's to judge when it resolves."""
    require_tier("process")
    tenants, tokens = _whole_network(tmp_path)
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        with Client(server.url, tokens.acme) as client:
            for host in (f"127.0.0.1:{server.port}", "169.254.169.254", "[::1]:6379", "10.0.0.1:443"):
                with pytest.raises(exc.PolicyDenied, match="not a public address") as refused:
                    RemoteSandbox.create(
                        tier="process", network=NetworkPolicy(allow_hosts=(host,)), client=client
                    )
                assert refused.value.rule == "network.allow_hosts", host
            assert client.sandboxes() == []
            with RemoteSandbox.create(
                tier="process", network=NetworkPolicy(allow_hosts=("pypi.org", "8.8.8.8:53")), client=client
            ) as sbx:  # public: given
                assert sbx.alive
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_a_docker_tier_without_its_walls_never_gives_a_tenant_the_whole_network(tmp_path: Path) -> None:
    """An engine on another host (or a service that cannot write firewall rules) leaves a
    full-network container reaching the engine host's listeners and private addresses: the
    service refuses it, whatever allow_weaker, and still gives an allowlist."""
    require_tier("docker")
    tenants, tokens = _whole_network(tmp_path, '"process", "docker"')
    server = Server(
        tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path, env={"STOCKADE_DOCKER_REMOTE": "1"}
    )
    try:
        with Client(server.url, tokens.acme) as client:
            with pytest.raises(exc.LimitNotEnforceable, match="another host") as refused:
                RemoteSandbox.create(tier="docker", network=NetworkPolicy(enabled=True), allow_weaker=True,
                                     client=client)  # fmt: skip
            assert refused.value.setting == "network"
            assert client.sandboxes() == []
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]
