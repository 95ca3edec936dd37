"""Roles within one tenant, through ``stockade serve`` (real uvicorn, SQLite, the process
tier): a sandbox, its snapshots and its pause, and a run, belong to the role that made them. The tenant's
policy keeps a data class (``records/**``) to role ``admin``; a ``dev`` token finds none of
what an admin token made (404 on every route, as for another tenant's ids), while a second
token of role ``admin`` uses it all, and the audit trail names the token of each call. A role's
``tools`` hold over the sandbox API: each call is refused (403) where the tool it amounts to is
not the role's; and over a run's acceptance check, the caller's command, judged as the sandbox
API's ``/commands`` judges one (tenant ``locked``'s policy denies ``execute``). A data class's
``tools`` hold over the sandbox API too (tenant ``labs`` keeps one to ``read_file``). A role
that runs no code gets a sandbox and runs under a data class it may read and not write (tenant
``press``), and its sandbox runs no code afterwards; a run whose sandbox no tier would start is
refused when it is submitted."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
from typer.testing import CliRunner

from stockade import Limits, Sandbox
from stockade import exceptions as exc
from stockade.cli.main import app
from stockade.client import Client, RemoteSandbox
from stockade.sandbox.snapshots import SnapshotStore
from tests.conftest import require_tier, wait_for
from tests.integration.service_env import Server

pytestmark = [pytest.mark.process]

LIMITS = Limits(memory_mb=256, timeout_s=20)
RECORD = "records/patient.txt"

POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted:*"]
[commands]
approve = ["rm -r"]
[[data]]
paths = ["records/**"]
tier = "restricted"
[data_access.restricted]
read = ["admin"]
write = ["admin"]
[roles.admin]
tiers = ["process"]
[roles.dev]
tiers = ["process"]
[roles.reader]
tiers = ["process"]
tools = ["read_file", "list_files"]
[roles.coder]
tiers = ["process"]
tools = ["read_file", "run_code"]
[roles.searcher]
tiers = ["process"]
tools = ["search_web"]
"""

LOCKED_POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted:*"]
[decisions]
deny = ["execute"]
[roles.dev]
tiers = ["process"]
"""

REPORT = "reports/2024/q3.txt"

# A data class kept to read_file, and a role that may read and write it but runs no code (code of
# a tool the class's list leaves out would keep the class out of the sandbox).
LABS_POLICY = """\
version = 1
[trust]
level = "trusted"
[[data]]
paths = ["reports/**"]
tier = "confidential"
[data_access.confidential]
read = ["analyst"]
write = ["analyst"]
tools = ["read_file"]
[roles.analyst]
tiers = ["process"]
tools = ["read_file", "list_files", "write_file"]
[roles.intern]
tiers = ["process"]
tools = ["read_file", "list_files", "write_file"]
"""


# A data class its roles may read and not write, under the default write rules (everything):
# no kernel keeps a part of a written folder read-only, so a role that runs code gets no sandbox;
# one that runs none needs no such hold (its tools' writes are each judged by the class's rule).
PRESS_POLICY = """\
version = 1
[trust]
level = "trusted"
[models]
approved = ["scripted:*"]
[paths]
write = ["**"]
[[data]]
paths = ["reports/**"]
tier = "confidential"
[data_access.confidential]
read = ["viewer", "coder"]
write = []
[roles.viewer]
tiers = ["process"]
tools = ["read_file"]
[roles.coder]
tiers = ["process"]
tools = ["read_file", "run_code"]
"""


@dataclass(frozen=True)
class Acme:
    server: Server
    folder: Path
    admin: str  # two tokens of role admin, one of role dev
    admin_id: str
    second_admin: str
    second_admin_id: str
    dev: str
    reader: str  # tools: read_file, list_files
    coder: str  # tools: read_file, run_code
    searcher: str  # a tool of its own, none a sandbox's call amounts to
    locked: str  # of tenant locked, whose policy denies execute
    analyst: str  # of tenant labs, whose data class is kept to read_file
    intern: str  # of tenant labs, which may neither read nor write its data class
    viewer: str  # of tenant press: read_file alone, under a class it may read and not write
    press_coder: str  # of tenant press: read_file and run_code


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Acme]:
    from stockade.server.tenants import Tenants, new_token

    require_tier("process")
    folder = tmp_path_factory.mktemp("roles")
    (folder / "policy.toml").write_text(POLICY)
    (folder / "locked.toml").write_text(LOCKED_POLICY)
    (folder / "labs.toml").write_text(LABS_POLICY)
    (folder / "press.toml").write_text(PRESS_POLICY)
    admin, admin_record = new_token("acme", "admin")
    second, second_record = new_token("acme", "admin")
    dev, dev_record = new_token("acme", "dev")
    reader, reader_record = new_token("acme", "reader")
    coder, coder_record = new_token("acme", "coder")
    searcher, searcher_record = new_token("acme", "searcher")
    locked, locked_record = new_token("locked", "dev")
    analyst, analyst_record = new_token("labs", "analyst")
    intern, intern_record = new_token("labs", "intern")
    viewer, viewer_record = new_token("press", "viewer")
    press_coder, press_coder_record = new_token("press", "coder")
    records = (
        admin_record, second_record, dev_record, reader_record, coder_record, searcher_record, locked_record,
        analyst_record, intern_record, viewer_record, press_coder_record,
    )  # fmt: skip
    empty = Tenants(tenants={}, tokens={})
    (folder / "tenants.toml").write_text(
        '[tenants.acme]\npolicy = "policy.toml"\nsandboxes = 4\ncpus = 4\nmemory_mb = 4096\n\n'
        '[tenants.locked]\npolicy = "locked.toml"\n\n[tenants.labs]\npolicy = "labs.toml"\n\n'
        '[tenants.press]\npolicy = "press.toml"\n\n' + "\n".join(empty.toml_lines(r) for r in records)
    )
    server = Server(
        folder / "tenants.toml", f"sqlite:///{folder / 'service.db'}", folder,
        extra=["--snapshot-dir", str(folder / "snapshots")],
    )  # fmt: skip
    try:
        yield Acme(
            server, folder, admin, admin_record.id, second, second_record.id, dev, reader, coder, searcher,
            locked, analyst, intern, viewer, press_coder,
        )  # fmt: skip
    finally:
        server.stop()
    assert server.proc.returncode in (0, -15), server.output()[-3000:]
    assert "Traceback" not in server.output(), server.output()[-3000:]


Call = tuple[str, str, dict[str, object]]


def statuses(acme: Acme, token: str, calls: list[Call]) -> dict[str, int]:
    """Each call's status code, by ``METHOD path {JSON body}``."""
    headers = {"Authorization": f"Bearer {token}"}
    found = {}
    with httpx2.Client(base_url=acme.server.url, headers=headers, timeout=30) as http:
        for method, path, how in calls:
            call = f"{method} {path} {json.dumps(how['json'])}" if "json" in how else f"{method} {path}"
            found[call] = http.request(method, path, **how).status_code  # type: ignore[arg-type]
    return found


def answers(acme: Acme, token: str, calls: list[Call]) -> dict[str, tuple[int, str | None]]:
    """Each call's status code and the rule its refusal names (None: none), as ``statuses``."""
    headers = {"Authorization": f"Bearer {token}"}
    found = {}
    with httpx2.Client(base_url=acme.server.url, headers=headers, timeout=30) as http:
        for method, path, how in calls:
            call = f"{method} {path} {json.dumps(how['json'])}" if "json" in how else f"{method} {path}"
            answer = http.request(method, path, **how)  # type: ignore[arg-type]
            problem = (
                answer.json() if answer.headers.get("content-type") == "application/problem+json" else {}
            )
            found[call] = (answer.status_code, problem.get("rule"))
    return found


def answer(acme: Acme, token: str, call: Call) -> tuple[int, str | None]:
    """One call's status code and the rule its refusal names (``answers``)."""
    (found,) = answers(acme, token, [call]).values()
    return found


@contextlib.contextmanager
def signed_in(acme: Acme, token: str) -> Iterator[httpx2.Client]:
    """A browser signed in to the run viewer with ``token``, through its form."""
    same_site = {"Sec-Fetch-Site": "same-origin"}
    with httpx2.Client(base_url=acme.server.url, timeout=30, headers=same_site) as form:
        signed = form.post("/ui/login", data={"token": token})
        assert signed.status_code == 303, signed.text
        cookies = {"stockade_viewer": form.cookies["stockade_viewer"]}
    with httpx2.Client(base_url=acme.server.url, timeout=30, cookies=cookies, headers=same_site) as page:
        yield page


def every_route(sandbox_id: str) -> list[Call]:
    base = f"/v1/sandboxes/{sandbox_id}"
    path: dict[str, object] = {"params": {"path": RECORD}}
    return [
        ("GET", base, {}),
        ("POST", f"{base}/code", {"json": {"code": f"print(open('{RECORD}').read())"}}),
        ("POST", f"{base}/code", {"json": {"code": f"print(open('{RECORD}').read())", "stream": True}}),
        ("POST", f"{base}/commands", {"json": {"cmd": f"cat {RECORD}"}}),
        ("POST", f"{base}/commands", {"json": {"cmd": f"cat {RECORD}", "stream": True}}),
        ("GET", f"{base}/files", {"params": {"path": "records"}}),
        ("GET", f"{base}/files/stat", path),
        ("GET", f"{base}/files/content", path),
        ("PUT", f"{base}/files/content", {**path, "content": b"overwritten"}),
        ("POST", f"{base}/files/dir", {"params": {"path": "records/more"}}),
        ("GET", f"{base}/archive", {"params": {"path": "records"}}),
        ("PUT", f"{base}/archive", {"content": b""}),
        ("DELETE", f"{base}/files", path),
        ("POST", f"{base}/reset", {}),
        ("POST", f"{base}/snapshot", {}),
        ("POST", f"{base}/pause", {}),
        ("POST", f"{base}/resume", {}),
        ("POST", f"{base}/kill", {}),
        ("DELETE", base, {}),
    ]


def actors(acme: Acme, sandbox_id: str, kind: str) -> list[str]:
    """The actors of the sandbox's audit events of ``kind``, as written to the trail."""
    with sqlite3.connect(acme.folder / "service.db") as db:
        rows = db.execute(
            "SELECT kind, body FROM audit_t_acme_events WHERE run_id = ? ORDER BY seq", (sandbox_id,)
        )
        return [json.loads(body)["actor"] for found, body in rows if found == kind]


def test_another_role_of_the_tenant_finds_no_sandbox_on_any_route(acme: Acme) -> None:
    with (
        Client(acme.server.url, acme.admin) as admin,
        Client(acme.server.url, acme.dev) as dev,
        RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx,
    ):
        sbx.files.write(RECORD, "PHI: Jane Doe")
        refused = statuses(acme, acme.dev, every_route(sbx.id))
        assert refused == dict.fromkeys(refused, 404)  # as another tenant's, or none
        assert [s["id"] for s in dev.sandboxes()] == []
        with pytest.raises(exc.ResourceNotFound):
            RemoteSandbox(dev, {"id": sbx.id}).run_code(f"print(open('{RECORD}').read())")
        # untouched: not killed, paused, reset nor written by any of those
        assert sbx.alive and sbx.files.read(RECORD) == "PHI: Jane Doe"
        assert [s["id"] for s in admin.sandboxes()] == [sbx.id]


def test_a_token_of_the_same_role_uses_it_and_the_trail_names_each_calls_token(acme: Acme) -> None:
    with Client(acme.server.url, acme.admin) as admin, Client(acme.server.url, acme.second_admin) as second:
        with RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx:
            sbx.files.write(RECORD, "PHI: Jane Doe")
            theirs = RemoteSandbox(second, {"id": sbx.id})
            assert theirs.run_code(f"print(open('{RECORD}').read())").logs.stdout.strip() == "PHI: Jane Doe"
            sbx.run_code("print('mine')")
            streamed: list[str] = []
            theirs.commands.run("echo streamed", on_stdout=streamed.append)
            theirs.files.remove(RECORD)
            assert [s["id"] for s in second.sandboxes()] == [sbx.id]
        first, other = f"api:{acme.admin_id}", f"api:{acme.second_admin_id}"
        wait_for(lambda: actors(acme, sbx.id, "sandbox_stop"), what="the sandbox's stop in the trail")
        assert actors(acme, sbx.id, "sandbox_start") == [first]  # who made it
        assert actors(acme, sbx.id, "run_code") == [other, first]  # who made each call
        assert actors(acme, sbx.id, "file_write") == [first]
        assert actors(acme, sbx.id, "file_remove") == [other]
        assert "".join(streamed) == "streamed\n" and actors(acme, sbx.id, "command") == [other]


def test_a_snapshot_and_a_pause_are_the_roles_that_took_them(acme: Acme) -> None:
    with Client(acme.server.url, acme.admin) as admin, Client(acme.server.url, acme.dev) as dev, \
            Client(acme.server.url, acme.second_admin) as second:  # fmt: skip
        with RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx:
            sbx.files.write(RECORD, "PHI: Jane Doe")
            snap = sbx.snapshot()
        paused_sbx = RemoteSandbox.create("process", limits=LIMITS, client=admin)
        paused_sbx.files.write(RECORD, "PHI: John Roe")
        paused = paused_sbx.pause()

        assert dev.snapshots() == []
        refused = statuses(acme, acme.dev, [
            ("GET", f"/v1/snapshots/{snap.id}", {}),
            ("GET", f"/v1/snapshots/{paused.id}", {}),
            ("POST", "/v1/sandboxes", {"json": {"snapshot": snap.id}}),
            ("POST", "/v1/sandboxes", {"json": {"snapshot": paused.id}}),
            ("GET", f"/v1/sandboxes/{paused_sbx.id}", {}),
            ("POST", f"/v1/sandboxes/{paused_sbx.id}/resume", {}),
            ("DELETE", f"/v1/snapshots/{snap.id}", {}),
            ("DELETE", f"/v1/snapshots/{paused.id}", {}),
        ])  # fmt: skip
        assert refused == dict.fromkeys(refused, 404)
        assert dev.sandboxes() == []

        # the role's other token: listed, restored, resumed, deleted
        assert {s["id"] for s in second.snapshots()} == {snap.id, paused.id}
        with RemoteSandbox.create(snapshot=snap, client=second) as fork:
            assert fork.files.read(RECORD) == "PHI: Jane Doe"
        with RemoteSandbox.resume(paused_sbx.id, client=second) as back:
            assert back.files.read(RECORD) == "PHI: John Roe"
        second.delete_snapshot(snap)
        assert admin.snapshots() == []


def test_a_run_its_events_and_its_approvals_are_the_roles_that_submitted_it(acme: Acme) -> None:
    with Client(acme.server.url, acme.admin) as admin, Client(acme.server.url, acme.dev) as dev, \
            Client(acme.server.url, acme.second_admin) as second:  # fmt: skip
        step = {
            "name": "run_code",
            "args": {"code": "mkdir -p records && rm -r records && echo gone", "language": "bash"},
        }
        run = admin.runs.submit("tidy the records", scripted=[step, "tidied"], idempotency_key="tidy")
        assert run.wait().status == "paused"  # its rm -r waits for a decision
        request_id = run.refresh().info["pending_approvals"][0]["id"]

        base = f"/v1/runs/{run.id}"
        refused = statuses(acme, acme.dev, [
            ("GET", base, {}),
            ("GET", f"{base}/events", {}),
            ("GET", f"{base}/approvals", {}),
            ("POST", f"{base}/approvals/{request_id}", {"json": {"decision": "approve"}}),
            ("POST", f"{base}/resume", {}),
            ("GET", f"{base}/diff", {}),
            ("GET", f"{base}/artifacts", {}),
            ("DELETE", f"{base}/artifacts", {}),
            ("POST", f"{base}/kill", {"json": {}}),
            ("DELETE", base, {}),
        ])  # fmt: skip
        assert refused == dict.fromkeys(refused, 404)
        assert all(r.id != run.id for r in dev.runs.list())
        with signed_in(acme, acme.dev) as page, signed_in(acme, acme.second_admin) as theirs:
            for path in (f"/ui/runs/{run.id}", f"/ui/runs/{run.id}/body"):
                assert page.get(path).status_code == 404, path
            assert page.get(f"/ui/runs/{run.id}/events").text == "event: end\ndata: {}\n\n"  # as for no run
            assert run.id not in page.get("/ui/").text
            assert run.id in theirs.get("/ui/").text and theirs.get(f"/ui/runs/{run.id}").status_code == 200
        # the key is each role's: dev's submit with admin's key makes dev's own run, neither
        # refused with a 409 naming admin's run (as it was) nor answered with it
        mine = dev.runs.submit("tidy", scripted=["nothing to tidy"], idempotency_key="tidy")
        assert mine.id != run.id
        assert dev.runs.submit("tidy", scripted=["nothing to tidy"], idempotency_key="tidy").id == mine.id
        assert mine.wait().status == "success"
        same = admin.runs.submit("tidy the records", scripted=[step, "tidied"], idempotency_key="tidy")
        assert same.id == run.id
        with pytest.raises(exc.RunConflict, match=mine.id):  # a different request: its own run named
            dev.runs.submit("tidy the rest", scripted=["nothing"], idempotency_key="tidy")
        assert run.refresh().status == "paused"  # neither decided nor killed by dev

        # the role's other token: listed, decided, and the run goes on
        assert [r.id for r in second.runs.list()] == [run.id]
        second.runs.get(run.id).approve(request_id)
        assert run.wait().status == "success"


def test_an_uploaded_workspace_is_the_roles_that_uploaded_it(acme: Acme, tmp_path: Path) -> None:
    (tmp_path / "records").mkdir()
    (tmp_path / RECORD).write_text("PHI: Jane Doe")
    with Client(acme.server.url, acme.admin) as admin, Client(acme.server.url, acme.dev) as dev, \
            Client(acme.server.url, acme.second_admin) as second:  # fmt: skip
        kept = admin.runs.upload_workspace(tmp_path)
        step = {"name": "read_file", "args": {"path": RECORD}}
        run = admin.runs.submit("read the record", scripted=[step, "read"], workspace=kept)

        assert dev.workspaces() == []  # neither its id nor its size
        assert statuses(acme, acme.dev, [("DELETE", f"/v1/workspaces/{kept}", {})]) == {
            f"DELETE /v1/workspaces/{kept}": 404  # not "in use by run ...", nor deleted
        }
        with pytest.raises(exc.InvalidArgument, match="no workspace"):  # as one never uploaded
            dev.runs.submit("read the record", scripted=[step, "read"], workspace=kept)
        # the same files uploaded by dev are dev's copy: its delete leaves the admin's alone
        assert dev.runs.upload_workspace(tmp_path) == kept
        assert [w["id"] for w in dev.workspaces()] == [kept]
        dev.delete_workspace(kept)
        assert dev.workspaces() == []

        # the role's other token: listed, run from, deleted
        assert run.wait().status == "success"
        assert [w["id"] for w in second.workspaces()] == [kept]
        again = second.runs.submit("read the record", scripted=[step, "read"], workspace=kept)
        assert again.wait().status == "success"
        second.delete_workspace(kept)
        assert admin.workspaces() == []


def test_a_process_without_the_snapshot_store_says_where_a_snapshot_is_to_its_role_alone(acme: Acme) -> None:
    apart = Server(
        acme.folder / "tenants.toml", f"sqlite:///{acme.folder / 'service.db'}", acme.folder,
        extra=["--snapshot-dir", str(acme.folder / "snapshots-apart")],
    )  # fmt: skip
    try:
        with Client(acme.server.url, acme.admin) as admin:
            with RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx:
                snap = sbx.snapshot()
            paused = RemoteSandbox.create("process", limits=LIMITS, client=admin)
            paused.pause()
        asked = [
            ("POST", "/v1/sandboxes", {"json": {"snapshot": snap.id}}),
            ("POST", f"/v1/sandboxes/{paused.id}/resume", {}),
        ]
        missing = {f"no snapshot {snap.id!r}", f"no paused sandbox {paused.id!r}"}
        for token, told in ((acme.second_admin, True), (acme.dev, False)):
            headers = {"Authorization": f"Bearer {token}"}
            with httpx2.Client(base_url=apart.url, headers=headers, timeout=30) as http:
                answers = [http.request(method, path, **how) for method, path, how in asked]  # type: ignore[arg-type]
            assert [a.status_code for a in answers] == [404, 404]
            details = {a.json()["detail"] for a in answers}
            if told:  # the role's own: where it is, and how to reach it
                assert all("is kept in the snapshot store of" in d and "--snapshot-dir" in d for d in details)
            else:  # another role's: as an id that never was, nothing says it is kept somewhere
                assert details == missing, details
    finally:
        apart.stop()
    with Client(acme.server.url, acme.admin) as admin:
        admin.delete_snapshot(snap)
        RemoteSandbox.resume(paused.id, client=admin).close()


def test_the_operator_lists_and_deletes_the_snapshots_that_name_no_role(acme: Acme) -> None:
    """A snapshot or a paused sandbox kept by a stockade from before they were a role's names
    no role: no token of acme (whose policy has roles) reaches it, yet it counts against its
    snapshot_mb. ``stockade snapshots`` lists and deletes those, while the service runs."""
    store = SnapshotStore(acme.folder / "snapshots" / "acme")
    with Client(acme.server.url, acme.admin) as admin:
        with RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx:
            sbx.files.write("old.bin", os.urandom(1024 * 1024))
            old = sbx.snapshot()
        paused_sbx = RemoteSandbox.create("process", limits=LIMITS, client=admin)
        paused_sbx.files.write("paused.bin", os.urandom(1024 * 1024))
        paused = paused_sbx.pause()
        with RemoteSandbox.create("process", limits=LIMITS, client=admin) as sbx:
            mine = sbx.snapshot()
        # their refs as an older stockade wrote them: no role
        store.set_ref("kept", old.id, old.id, source=sbx.id)
        store.set_ref("paused", paused_sbx.id, paused.id)
        assert [s["id"] for s in admin.snapshots()] == [mine.id]
        before = store.size()

        cli, where = CliRunner(), ["--snapshot-dir", str(store.root)]
        listed = cli.invoke(app, ["snapshots", "list", *where, "--no-role", "--json"])
        assert listed.exit_code == 0, listed.output
        assert {h["id"] for h in json.loads(listed.output)} == {old.id, paused.id}
        deleted = cli.invoke(app, ["snapshots", "delete", *where, "--no-role"])
        assert deleted.exit_code == 0, deleted.output
        assert "2 snapshot(s) deleted" in deleted.output

        assert before - store.size() >= 2 * 1024 * 1024  # their bytes left the tenant's snapshot_mb
        assert [s["id"] for s in admin.snapshots()] == [mine.id]  # the role's own is left
        with pytest.raises(exc.SnapshotNotFound):
            RemoteSandbox.resume(paused_sbx.id, client=admin)
        admin.delete_snapshot(mine)


def test_the_operator_lists_and_deletes_the_workspaces_that_name_no_role(acme: Acme, tmp_path: Path) -> None:
    """A workspace uploaded before workspaces were a role's names none (the service's upgrade
    gives it role ''): no token of acme lists, uses or deletes it, yet it fills storage_mb.
    ``stockade workspaces`` lists every role's and deletes those."""
    (tmp_path / "a.txt").write_text("mine")
    with Client(acme.server.url, acme.admin) as admin:
        mine = admin.runs.upload_workspace(tmp_path)
        with sqlite3.connect(acme.folder / "service.db") as db:
            db.execute(
                "INSERT INTO svc_workspaces (tenant, role, digest, bytes, data, created_ns) "
                "VALUES (?, '', ?, ?, ?, 1)",
                ("acme", "sha256:" + "0" * 64, 5, b"older"),
            )
        assert [w["id"] for w in admin.workspaces()] == [mine]

        cli, where = CliRunner(), ["--db", f"sqlite:///{acme.folder / 'service.db'}", "--tenant", "acme"]
        listed = cli.invoke(app, ["workspaces", "list", *where, "--json"])
        assert listed.exit_code == 0, listed.output
        assert {(w["id"], w["role"]) for w in json.loads(listed.output)} == {
            (mine, "admin"),
            ("sha256:" + "0" * 64, None),
        }
        refused = cli.invoke(app, ["workspaces", "delete", *where, mine])  # the role's own: its tokens'
        assert refused.exit_code == 1, refused.output
        deleted = cli.invoke(app, ["workspaces", "delete", *where, "--no-role"])
        assert deleted.exit_code == 0 and "1 workspace(s) deleted" in deleted.output, deleted.output

        listed = cli.invoke(app, ["workspaces", "list", *where, "--json"])
        assert [w["id"] for w in json.loads(listed.output)] == [mine]
        admin.delete_workspace(mine)


def test_a_role_of_read_tools_reads_its_sandbox_and_writes_or_runs_nothing_by_any_route(acme: Acme) -> None:
    with Client(acme.server.url, acme.reader) as reader:
        with RemoteSandbox.create("process", limits=LIMITS, client=reader) as sbx:  # its tools use one
            base = f"/v1/sandboxes/{sbx.id}"
            snap = sbx.snapshot()  # read_file: the files go to the host's store, not to the caller
            made: dict[str, object] = {"params": {"path": "made.txt"}}
            refused = answers(acme, acme.reader, [
                ("POST", f"{base}/code", {"json": {"code": "open('made.txt', 'w')"}}),
                ("POST", f"{base}/code", {"json": {"code": "open('made.txt', 'w')", "stream": True}}),
                ("POST", f"{base}/commands", {"json": {"cmd": "touch made.txt"}}),
                ("POST", f"{base}/commands", {"json": {"cmd": "touch made.txt", "stream": True}}),
                ("PUT", f"{base}/files/content", {**made, "content": b"written"}),
                ("POST", f"{base}/files/dir", made),
                ("DELETE", f"{base}/files", made),
                ("PUT", f"{base}/archive", {"content": b""}),
                ("POST", f"{base}/reset", {}),
                ("POST", f"{base}/pause", {}),
                ("POST", f"{base}/resume", {}),
                ("POST", "/v1/sandboxes", {"json": {"snapshot": snap.id}}),
            ])  # fmt: skip
            assert refused == dict.fromkeys(refused, (403, "roles.reader.tools"))
            allowed = answers(acme, acme.reader, [
                ("GET", f"{base}/files", {}),
                ("GET", f"{base}/files/stat", {"params": {"path": "."}}),
                ("GET", f"{base}/files/content", made),
                ("GET", f"{base}/archive", {}),
                ("GET", base, {}),
            ])  # fmt: skip
            assert list(allowed.values()) == [(200, None), (200, None), (404, None), (200, None), (200, None)]
            assert sbx.alive and sbx.files.list("") == []  # nothing made, nothing emptied
        reader.delete_snapshot(snap)
        assert reader.sandboxes() == [] and reader.snapshots() == []


def test_a_role_with_run_code_runs_code_and_no_command(acme: Acme) -> None:
    with (
        Client(acme.server.url, acme.coder) as coder,
        RemoteSandbox.create("process", limits=LIMITS, client=coder) as sbx,
    ):
        assert sbx.run_code("print(6 * 7)").logs.stdout.strip() == "42"
        with pytest.raises(exc.PolicyDenied) as denied:
            sbx.commands.run("echo raw shell")
        assert denied.value.rule == "roles.coder.tools" and "shell" in str(denied.value)
        with pytest.raises(exc.PolicyDenied):
            sbx.files.write("a.txt", "written")


def test_a_role_with_no_tool_a_sandbox_serves_creates_none(acme: Acme) -> None:
    with Client(acme.server.url, acme.searcher) as searcher:
        with pytest.raises(exc.PolicyDenied) as denied:
            RemoteSandbox.create("process", limits=LIMITS, client=searcher)
        assert denied.value.rule == "roles.searcher.tools"
        assert searcher.sandboxes() == []  # nothing started, nothing held against the quota


def test_a_role_that_may_run_no_command_submits_no_run_with_an_acceptance_check(acme: Acme) -> None:
    """A run's check is the caller's shell line, run in the run's sandbox: a role of read tools,
    refused ``/commands`` and ``/code``, ran any code as a check before (its files in the run's
    diff and artifacts)."""
    with Client(acme.server.url, acme.reader) as reader:
        before = [r.id for r in reader.runs.list()]
        with pytest.raises(exc.PolicyDenied) as denied:
            reader.runs.submit("look around", scripted=["looked"], check="echo PWNED > pwned.txt")
        assert denied.value.rule == "roles.reader.tools"
        assert "'shell', which the run's acceptance check (a command) amounts to" in str(denied.value)
        assert [r.id for r in reader.runs.list()] == before  # nothing queued, nothing ran
        # without a check, the role's run reads as before
        assert reader.runs.submit("look around", scripted=["looked"]).wait().status == "success"


def test_a_tenant_whose_policy_denies_execute_runs_no_acceptance_check(acme: Acme) -> None:
    with Client(acme.server.url, acme.locked) as locked:
        with pytest.raises(exc.PolicyDenied) as denied:
            locked.runs.submit("t", scripted=["done"], check="id")
        assert denied.value.rule == "decisions.deny: execute"
        assert locked.runs.list() == []


def test_an_acceptance_check_is_judged_as_the_same_command_through_the_sandbox_api(acme: Acme) -> None:
    """The role's command rules over the check's line, in the words ``/commands`` has for it: the
    policy asks an approval for ``rm -r``, which no one can give there, nor for a check."""
    line = "rm -r build"
    with (
        Client(acme.server.url, acme.dev) as dev,
        RemoteSandbox.create("process", limits=LIMITS, client=dev) as sbx,
    ):
        with pytest.raises(exc.PolicyDenied) as through_the_api:
            sbx.commands.run(line)
        before = [r.id for r in dev.runs.list()]
        with pytest.raises(exc.PolicyDenied) as as_a_check:
            dev.runs.submit("t", scripted=["done"], check=line)
        assert (as_a_check.value.rule, str(as_a_check.value)) == (
            through_the_api.value.rule,
            str(through_the_api.value),
        )
        assert [r.id for r in dev.runs.list()] == before


@pytest.mark.parametrize("hidden", ["{ rm -r made; }", "f(){ rm -r made; }; f"])
def test_a_check_hiding_a_command_to_approve_has_it_refused_inside_and_asks_no_one(
    acme: Acme, hidden: str
) -> None:
    """The line's words show no ``rm -r`` (a group, a function), so the check is taken; what it
    runs meets the sandbox's exec judge, which refuses it at once, each time, asking no one:
    it neither waits for a yes nor runs. It left a request in the run's book before, and a yes
    to it ran ``rm -r`` at the next check."""
    with Client(acme.server.url, acme.dev) as dev:
        check = f"mkdir -p made && echo kept > made/kept.txt && {hidden}"
        run = dev.runs.submit("t", scripted=["done"] * 3, check=check)
        assert run.wait(timeout_s=60).status == "check_failed"
        events = list(run.events())
        assert [e.data for e in events if e.kind == "approval"] == []  # nothing asked, nothing to approve
        checks = [e.data["attributes"] for e in events if e.kind == "check"]
        assert [(c["passed"], c["timed_out"], c["exit_code"]) for c in checks] == [(False, False, 126)] * 3
        removals = [
            e.data["attributes"] for e in events if e.kind == "exec" and "rm" in e.data["attributes"]["argv"]
        ]
        assert removals and {(r["verdict"], r["rule"]) for r in removals} == {
            ("refuse", "commands.approve: rm -r")
        }
        assert "+kept" in run.diff()  # never removed
        run.delete()


def test_a_role_that_may_run_commands_runs_its_acceptance_check(acme: Acme) -> None:
    with Client(acme.server.url, acme.dev) as dev:
        run = dev.runs.submit("t", scripted=["done"], check="echo checked > checked.txt")
        assert run.wait().status == "success"
        assert "+checked" in run.diff()
        run.delete()


def tar_of(name: str, data: bytes) -> bytes:
    held = io.BytesIO()
    with tarfile.open(fileobj=held, mode="w") as tar:
        entry = tarfile.TarInfo(name)
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))
    return held.getvalue()


@contextlib.contextmanager
def analysts_report(acme: Acme, tmp_path: Path, analyst: Client) -> Iterator[RemoteSandbox]:
    """A sandbox of labs' analyst holding ``REPORT``. No call of the API writes the class (its
    ``tools`` are read_file alone), nor uploads it: its file comes from a snapshot of the role's,
    as a workspace is given to a run."""
    (tmp_path / REPORT).parent.mkdir(parents=True)
    (tmp_path / REPORT).write_text("Q3: 42")
    store = SnapshotStore(acme.folder / "snapshots" / "labs")
    with Sandbox.create("process", limits=LIMITS, workspace=tmp_path) as local:
        taken = local.snapshot(store=store)
    store.set_ref("kept", taken.id, taken.id, source=local.id, role="analyst")
    try:
        with RemoteSandbox.create("process", limits=LIMITS, client=analyst, snapshot=taken.id) as sbx:
            yield sbx
    finally:
        analyst.delete_snapshot(taken.id)


def test_a_data_class_kept_to_read_file_is_read_through_its_calls_alone(acme: Acme, tmp_path: Path) -> None:
    """``data_access.confidential.tools = ["read_file"]``: the API judges each op with the tool
    its call amounts to, as a run judges each with the tool that issued it. The class's file is
    read (its content, its entry, its folder's download); a listing or a write of the class is
    refused by the class's rule. Before, the API judged every op with no tool, and the class's
    ``tools`` were skipped: its folders were listed, its files overwritten and removed."""
    folder: dict[str, object] = {"params": {"path": "reports/2024"}}
    report: dict[str, object] = {"params": {"path": REPORT}}
    with (
        Client(acme.server.url, acme.analyst) as analyst,
        analysts_report(acme, tmp_path, analyst) as sbx,
    ):
        base = f"/v1/sandboxes/{sbx.id}"
        refused = answers(acme, acme.analyst, [
            ("GET", f"{base}/files", folder),  # list_files
            ("PUT", f"{base}/files/content", {**report, "content": b"Q3: 0"}),  # write_file
            ("POST", f"{base}/files/dir", {"params": {"path": "reports/2024/more"}}),
            ("PUT", f"{base}/archive", {**folder, "content": tar_of("q4.txt", b"Q4: 0")}),
            ("DELETE", f"{base}/files", report),
        ])  # fmt: skip
        assert refused == dict.fromkeys(refused, (403, "data_access.confidential.tools"))
        allowed = answers(acme, acme.analyst, [  # read_file
            ("GET", f"{base}/files/content", report),
            ("GET", f"{base}/files/stat", report),
            ("GET", f"{base}/archive", folder),
        ])  # fmt: skip
        assert list(allowed.values()) == [(200, None)] * 3
        assert sbx.files.read(REPORT) == "Q3: 42"  # neither overwritten nor removed
        # a command or code reading it: refused as before, the role runs none
        code = answers(acme, acme.analyst, [
            ("POST", f"{base}/commands", {"json": {"cmd": f"cat {REPORT}"}}),
            ("POST", f"{base}/code", {"json": {"code": f"print(open('{REPORT}').read())"}}),
        ])  # fmt: skip
        assert code == dict.fromkeys(code, (403, "roles.analyst.tools"))
        # outside the class, the role's tools as ever
        sbx.files.write("notes.txt", "read the report")
        assert {e.path for e in sbx.files.list("")} == {"notes.txt", "reports"}


def tar_names(data: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {name.removeprefix("./") for name in tar.getnames()} - {".", ""}


def test_the_root_and_the_class_folder_hold_the_class_for_its_downloads_listings_and_uploads(
    acme: Acme, tmp_path: Path
) -> None:
    """A folder above a class (the root, ``reports``) holds the class: a listing that reaches its
    files and an archive put that writes them are judged by its rules, as a read or a write of
    one of its files is. Before, each was judged by its folder alone: a tar put at the root wrote
    into the class with a tool its ``tools`` leave out, or by a role that may not write it, and
    ``reports`` was listed with ``list_files``."""
    root: dict[str, object] = {"params": {"path": ""}}
    deep: dict[str, object] = {"params": {"path": "", "depth": 2}}
    into = tar_of("reports/2024/q4.txt", b"Q4: 0")
    notes = tar_of("notes.txt", b"notes")
    with (
        Client(acme.server.url, acme.analyst) as analyst,
        analysts_report(acme, tmp_path, analyst) as sbx,
    ):
        base = f"/v1/sandboxes/{sbx.id}"
        refused = [
            answer(acme, acme.analyst, ("GET", f"{base}/files", deep)),  # list_files, to reports/2024
            answer(acme, acme.analyst, ("GET", f"{base}/files", {"params": {"path": "reports"}})),
            answer(acme, acme.analyst, ("PUT", f"{base}/archive", {**root, "content": into})),  # write_file
        ]
        assert refused == [(403, "data_access.confidential.tools")] * 3
        # the folder reports, none of its files; a file beside the class
        assert answer(acme, acme.analyst, ("GET", f"{base}/files", root)) == (200, None)
        assert answer(acme, acme.analyst, ("PUT", f"{base}/archive", {**root, "content": notes})) == (
            204,
            None,
        )
        download = sbx.files.download_dir(tmp_path / "out")  # read_file: the class's own tool
        assert (tmp_path / "out" / REPORT).read_text() == "Q3: 42", download
        assert not sbx.files.exists("reports/2024/q4.txt")

    with (
        Client(acme.server.url, acme.intern) as intern,
        RemoteSandbox.create("process", limits=LIMITS, client=intern) as sbx,
    ):
        base = f"/v1/sandboxes/{sbx.id}"
        put = answer(acme, acme.intern, ("PUT", f"{base}/archive", {**root, "content": into}))
        assert put == (403, "data_access.confidential.write")
        assert answer(acme, acme.intern, ("PUT", f"{base}/archive", {**root, "content": notes})) == (
            204,
            None,
        )
        with httpx2.Client(
            base_url=acme.server.url, headers={"Authorization": f"Bearer {acme.intern}"}
        ) as http:
            whole = http.get(f"{base}/archive", params={"path": ""})
            listed = http.get(f"{base}/files", params={"path": "", "depth": 32})
        assert whole.status_code == listed.status_code == 200
        assert tar_names(whole.content) == {"notes.txt"}  # the whole workspace, none of the class
        assert {e["path"] for e in listed.json()} == {"notes.txt"}


def test_a_role_that_runs_no_code_gets_a_sandbox_and_runs_under_a_class_it_may_not_write(
    acme: Acme, tmp_path: Path
) -> None:
    """Tenant press: ``reports/**`` is the viewer's to read, not to write, and everything is
    written (``paths.write = ["**"]``). The viewer's tools run no code: its sandbox was asked to
    keep the class read-only from code all the same, which no kernel holds beneath a written
    folder. Before, its every sandbox was refused (422, ``data_access.confidential.write``), and
    its runs were accepted (202) and then ended ``error``."""
    (tmp_path / REPORT).parent.mkdir(parents=True)
    (tmp_path / REPORT).write_text("Q3: 42")
    with Client(acme.server.url, acme.viewer) as viewer:
        with RemoteSandbox.create("process", limits=LIMITS, client=viewer) as sbx:
            assert not sbx.files.exists(REPORT)  # read_file: looking at a file
            with pytest.raises(exc.PolicyDenied) as denied:  # as ever: the role runs no code
                sbx.run_code(f"open('{REPORT}', 'w')")
            assert denied.value.rule == "roles.viewer.tools"
        kept = viewer.runs.upload_workspace(tmp_path)
        step = {"name": "read_file", "args": {"path": REPORT}}
        run = viewer.runs.submit("read the report", scripted=[step, "read"], workspace=kept)
        assert run.wait().status == "success", run.info
        assert run.diff() == ""  # read, not changed
        run.delete()
        viewer.delete_workspace(kept)
        assert viewer.sandboxes() == [] and viewer.workspaces() == []


def test_a_run_whose_sandbox_no_tier_would_start_is_refused_when_it_is_submitted(acme: Acme) -> None:
    """Tenant press's coder runs code, so the class must stay read-only to it, beneath the
    written ``**``: no tier holds that, and a run takes no ``allow_weaker``. Refused at once
    (422, with the setting and what to change in the policy), as a sandbox of the role is;
    before, the run was accepted (202) and then ended ``error``."""
    with Client(acme.server.url, acme.press_coder) as coder:
        with pytest.raises(exc.LimitNotEnforceable) as refused:
            coder.runs.submit("read the report", scripted=["read"])
        assert refused.value.setting == "data_access.confidential.write"
        assert "narrow paths.write" in (refused.value.fix or "")
        assert "allow_weaker" not in (refused.value.fix or "")
        assert coder.runs.list() == []  # nothing queued
        with pytest.raises(exc.LimitNotEnforceable) as no_sandbox:
            RemoteSandbox.create("process", limits=LIMITS, client=coder)
        assert no_sandbox.value.setting == "data_access.confidential.write"
        assert coder.sandboxes() == []


def test_a_sandbox_of_a_role_that_ran_no_code_runs_none_once_the_role_may(acme: Acme) -> None:
    """The viewer's sandbox keeps nothing read-only from code. The policy, loaded again,
    gives the viewer ``run_code``: its live sandbox still runs no code (its rules were made for
    a role that ran none), while a new sandbox of the role gets the rules for code (here: none
    can start). Before, the live sandbox ran the code, and it overwrote the class."""
    press = acme.folder / "press.toml"

    def loaded(policy: str) -> None:
        press.write_text(policy)
        acme.server.proc.send_signal(signal.SIGHUP)  # a policy file the tenants file names

    with Client(acme.server.url, acme.viewer) as viewer:
        with RemoteSandbox.create("process", limits=LIMITS, client=viewer) as sbx:
            try:
                loaded(PRESS_POLICY.replace('tools = ["read_file"]', 'tools = ["read_file", "run_code"]'))

                def refused_as_started() -> str:
                    try:
                        sbx.run_code(f"import os; os.makedirs('reports/2024'); open('{REPORT}', 'w')")
                    except exc.PolicyDenied as denied:
                        return str(denied) if "when this sandbox started" in str(denied) else ""
                    return "ran"

                found = wait_for(refused_as_started, what="the policy to be loaded again", timeout_s=10)
                assert found != "ran" and "create a new sandbox" in found
                assert not sbx.files.exists(REPORT)
                with pytest.raises(exc.LimitNotEnforceable):  # a new sandbox: the rules for code
                    RemoteSandbox.create("process", limits=LIMITS, client=viewer)
            finally:
                loaded(PRESS_POLICY)
        back = wait_for(lambda: sandbox_of(viewer), what="the policy to be loaded back", timeout_s=10)
        assert back is not None
        back.close()
        assert viewer.sandboxes() == []


def sandbox_of(client: Client) -> RemoteSandbox | None:
    """A new sandbox of the client's role, or None where the role's rules start none."""
    try:
        return RemoteSandbox.create("process", limits=LIMITS, client=client)
    except exc.LimitNotEnforceable:
        return None
