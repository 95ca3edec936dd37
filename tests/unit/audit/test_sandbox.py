"""AuditedBackend / AuditedInstance over the shipped FakeBackend."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from stockade import CommandResult, SandboxFileNotFound, SandboxStartError
from stockade.audit import AuditedBackend, AuditEvent, AuditLog, Chain, Draft, EventKind, MemoryStore, verify
from stockade.audit.sandbox_texts import TEXT_CAP
from stockade.egress import EgressProxy, _loop
from stockade.exceptions import AuditStoreError
from stockade.sandbox import Sandbox
from stockade.sandbox.base import Instance, SandboxSpec
from stockade.sandbox.ops import HostFolder, MakeDir, Op, PutArchive, Remove, RunCommand, WriteFile
from stockade.testing import FakeBackend, MemoryWorkspace, capture_audit
from stockade.types import ExecRecord
from tests.conftest import wait_for
from tests.egress_servers import servers


def test_a_sandbox_session_becomes_audit_events() -> None:
    workspace = MemoryWorkspace(
        commands=lambda op: CommandResult(
            exit_code=3, stdout="hi\n", stderr="", duration_s=0.01, stdout_bytes=3
        )
    )
    with capture_audit() as audit:
        backend = AuditedBackend(FakeBackend(workspace), audit, run_id="run-1", step=lambda: 4)
        with Sandbox.create(backend=backend) as sbx:
            sbx.commands.run(["make", "test"], envs={"TOKEN": "value-never-recorded"})
            sbx.files.write("src/app.py", "print(1)\n")
            sbx.files.read("src/app.py")  # reads change nothing: not recorded
            sbx.files.remove("src/app.py")

        assert audit.kinds() == [
            EventKind.SANDBOX_START,
            EventKind.OP_START,  # a command is recorded as it starts too: a crash may cut it
            EventKind.COMMAND,
            EventKind.FILE_WRITE,
            EventKind.FILE_REMOVE,
            EventKind.SANDBOX_STOP,
        ]
        command = audit.of(EventKind.COMMAND)[0]
        assert command.run_id == "run-1" and command.step == 4 and command.actor == "sandbox"
        assert command.attributes["argv"] == ["make", "test"]
        assert audit.of(EventKind.OP_START)[0].attributes["argv"] == ["make", "test"]
        assert command.attributes["env_names"] == ["TOKEN"]
        assert command.attributes["exit_code"] == 3 and command.attributes["stdout_bytes"] == 3
        assert command.duration_ns is not None
        assert "value-never-recorded" not in str([e.body for e in audit.events])
        write = audit.of(EventKind.FILE_WRITE)[0]
        assert write.attributes["path"] == "src/app.py" and write.attributes["bytes"] == 9
        assert str(write.attributes["digest"]).startswith("sha256:")
        assert verify(audit.store).ok


def test_a_failed_operation_is_recorded_with_its_error_then_raised() -> None:
    with capture_audit() as audit:
        with (
            Sandbox.create(backend=AuditedBackend(FakeBackend(), audit, run_id="r")) as sbx,
            pytest.raises(SandboxFileNotFound),
        ):
            sbx.files.remove("missing.txt")
        (removal,) = audit.of(EventKind.FILE_REMOVE)
        assert removal.attributes["error"] == "SandboxFileNotFound"
        assert removal.attributes["retryable"] is False


class FailingBackend(FakeBackend):
    def start(self, spec: SandboxSpec) -> Instance:  # type: ignore[override]
        raise SandboxStartError("no room")


def test_a_failed_start_is_recorded() -> None:
    with capture_audit() as audit:
        with pytest.raises(SandboxStartError):
            AuditedBackend(FailingBackend(), audit, run_id="r").start(SandboxSpec())
        (start,) = audit.events
        assert start.kind == EventKind.SANDBOX_START
        assert start.attributes["error"] == "SandboxStartError" and start.attributes["retryable"] is True


def test_run_code_records_the_code_and_its_digest() -> None:
    with capture_audit() as audit:
        with Sandbox.create(backend=AuditedBackend(FakeBackend(), audit, run_id="r")) as sbx:
            sbx.run_code("x = 41\nx + 1")
        (run_code,) = audit.of(EventKind.RUN_CODE)
        assert run_code.attributes["code"] == "x = 41\nx + 1"
        assert str(run_code.attributes["code_digest"]).startswith("sha256:")


def test_an_upload_records_the_folder_it_came_from(tmp_path: Path) -> None:
    # Its tar is made as it is sent: there are no bytes to digest before, the folder is named.
    (tmp_path / "app.py").write_text("print(1)\n")
    with capture_audit() as audit:
        with Sandbox.create(backend=AuditedBackend(FakeBackend(), audit, run_id="r")) as sbx:
            sbx.files.upload_dir(tmp_path, "proj", hide=["*.env"])
            assert sbx.files.read("proj/app.py") == "print(1)\n"
        (upload,) = audit.of(EventKind.FILE_WRITE)
        assert upload.attributes["op"] == "put_archive" and upload.attributes["path"] == "proj"
        assert upload.attributes["source"] == str(tmp_path) and upload.attributes["hide"] == ["*.env"]


LONG_PATH = "a" * 1_000_000  # one name: nested folders would cost the fake workspace their every prefix


@pytest.mark.parametrize(
    "op",
    [
        WriteFile(path=LONG_PATH, data=b"x"),
        MakeDir(path=LONG_PATH),
        Remove(path=LONG_PATH),
        PutArchive(path=LONG_PATH, folder=HostFolder(source=Path("/" + "h" * 100_000))),
    ],
    ids=["write", "make_dir", "remove", "upload"],
)
def test_a_long_path_is_kept_as_its_head_size_and_digest(op: Op[Any]) -> None:
    """A path was copied whole into its event, and again in the error that repeats it: a
    remove of a 1,000,000-character path (from a route that does not refuse it as the SDK
    does) made an event of 3 MB. Now each is cut at TEXT_CAP, the path with its digest."""
    with capture_audit() as audit:
        instance = AuditedBackend(FakeBackend(), audit, run_id="r").start(SandboxSpec())
        with contextlib.suppress(Exception):
            instance.execute(op)
        (event,) = [e for e in audit.events if e.kind in (EventKind.FILE_WRITE, EventKind.FILE_REMOVE)]
    assert all(len(str(value)) < TEXT_CAP + 40 for value in event.attributes.values())  # each text cut
    assert event.attributes["path_bytes"] == len(LONG_PATH) and event.attributes["path_cut"] is True
    assert event.attributes["path_digest"] == "sha256:" + hashlib.sha256(LONG_PATH.encode()).hexdigest()
    assert str(event.attributes["path"]).startswith("aaaa")


def test_a_failed_operation_s_message_is_cut() -> None:
    with capture_audit() as audit:
        instance = AuditedBackend(FakeBackend(), audit, run_id="r").start(SandboxSpec())
        with pytest.raises(SandboxFileNotFound):
            instance.execute(Remove(path="m" * 100_000))
        (removal,) = audit.of(EventKind.FILE_REMOVE)
    assert removal.attributes["error"] == "SandboxFileNotFound"
    assert len(str(removal.attributes["error_message"])) < TEXT_CAP + 100


def test_many_labels_are_cut_like_a_list() -> None:
    labels = {f"team{i}": "x" * 100 for i in range(1000)}
    with capture_audit() as audit:
        AuditedBackend(FakeBackend(), audit, run_id="r").start(SandboxSpec(labels=labels)).close()
        (start,) = audit.of(EventKind.SANDBOX_START)
    assert len(json.dumps(start.attributes)) < 3 * TEXT_CAP
    assert start.attributes["labels_count"] == 1000 and start.attributes["labels_cut"] is True


def test_stop_is_recorded_once() -> None:
    with capture_audit() as audit:
        instance = AuditedBackend(FakeBackend(), audit, run_id="r").start(SandboxSpec())
        instance.close()
        instance.close()
        assert audit.kinds().count(EventKind.SANDBOX_STOP) == 1


def test_a_tunnel_held_open_is_in_the_trail_before_it_ends(tmp_path: Path) -> None:
    """The sandbox's proxy, told to the trail as the audited backend asks (``egress_observer``):
    an allowed tunnel is an ``egress_open`` event while it is open, then its ``egress`` event
    (one per request, as before) when it ends, both naming the tunnel."""
    backend = FakeBackend()
    with capture_audit() as audit, servers(tmp_path) as local:
        policy = local.policy(credentials=())
        instance = AuditedBackend(backend, audit, run_id="r").start(SandboxSpec(network=policy))
        proxy = EgressProxy(policy, observer=backend.specs[0].egress_observer)
        port = _loop.call(proxy.start_tcp())
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            target = f"api.test:{local.https_port}"
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            ctx = ssl.create_default_context(cafile=str(local.ca_file))
            with ctx.wrap_socket(sock, server_hostname="api.test"):
                wait_for(lambda: audit.of(EventKind.EGRESS_OPEN), what="the tunnel in the trail", timeout_s=5)
                assert audit.of(EventKind.EGRESS) == []  # still open
            wait_for(lambda: audit.of(EventKind.EGRESS), what="the tunnel's end", timeout_s=5)
        finally:
            _loop.call(proxy.close())
            instance.close()
        (opened,), (ended,) = audit.of(EventKind.EGRESS_OPEN), audit.of(EventKind.EGRESS)
        assert (opened.attributes["host"], opened.attributes["method"], opened.attributes["decision"]) == (
            "api.test", "CONNECT", "allow",
        )  # fmt: skip
        assert opened.attributes["tunnel"] == ended.attributes["tunnel"] != ""
        assert "phase" not in opened.attributes  # the kind says it
        assert verify(audit.store).ok


class AwayStore(MemoryStore):
    """A store that can no longer be written once ``away`` (its disk full, its database away)."""

    away = False

    def append(self, drafts: Sequence[Draft], chain: Chain) -> list[AuditEvent]:
        if self.away:
            raise AuditStoreError("disk full")
        return super().append(drafts, chain)


def test_no_action_is_taken_while_the_trail_cannot_be_written() -> None:
    """Fail closed: once a write of the trail failed, the next action is refused before it runs
    (it used to run, and its caller heard only at the next write, 0.2 s later, of which actions
    in between 34 of 40 returned as if recorded)."""
    ran: list[str] = []

    def command(op: RunCommand) -> CommandResult:
        ran.append(" ".join(op.argv))
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0.0)

    store = AwayStore()
    log = AuditLog(store, flush_interval_s=None)
    backend = AuditedBackend(FakeBackend(MemoryWorkspace(commands=command)), log, run_id="run-1")
    sbx = Sandbox.create(backend=backend)
    sbx.commands.run("first")
    store.away = True  # no write failed yet: the next action's check writes, and fails
    for _ in range(3):
        with pytest.raises(AuditStoreError):
            sbx.commands.run("rm -rf build")
    assert ran == ["/bin/sh -c first"]


def test_a_command_cut_in_the_trail_is_redacted_before_the_cut() -> None:
    key = "sk-" + "Q7w8E9r0T1y2U3i4O5p6A7s8D9f0G1h2J3k4L5z6"
    argument = "x" * (TEXT_CAP - 10) + " " + key  # the cut falls inside the key
    workspace = MemoryWorkspace(
        commands=lambda op: CommandResult(exit_code=0, stdout="", stderr="", duration_s=0)
    )
    with capture_audit() as audit:
        with Sandbox.create(backend=AuditedBackend(FakeBackend(workspace), audit, run_id="r")) as sbx:
            sbx.commands.run(["echo", argument])
        (command,) = audit.of(EventKind.COMMAND)
    kept = str(command.attributes["argv"])
    assert "more chars]" in kept and key[3:9] not in kept


def _ran(op: RunCommand) -> CommandResult:
    return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0)


def test_a_long_argv_is_kept_as_its_head_tail_size_and_digest() -> None:
    """One command of 60,000 random 14-character arguments (0.9 MB, under the service's 2 MiB)
    made a command event of 1.01 MB: each argument was cut to TEXT_CAP but all were kept, and
    the tenant's audit trail, kept for ever, grew by that much a call. Now the event keeps the
    first and last words, and the count, size and SHA-256 of the whole, which prove what ran."""
    argv = ["true", *(f"{n:014x}" for n in range(60_000))]
    with capture_audit() as audit:
        with Sandbox.create(
            backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=_ran)), audit, run_id="r")
        ) as sbx:
            sbx.commands.run(argv)
        (command,) = audit.of(EventKind.COMMAND)
        (started,) = audit.of(EventKind.OP_START)
    assert len(json.dumps(command.attributes)) < 2 * TEXT_CAP
    whole = json.dumps(argv, separators=(",", ":"), ensure_ascii=False).encode()
    assert command.attributes["argv_digest"] == "sha256:" + hashlib.sha256(whole).hexdigest()
    assert command.attributes["argv_bytes"] == len(whole) and command.attributes["argv_count"] == 60_001
    kept = command.attributes["argv"]
    assert isinstance(kept, list)
    assert kept[:2] == argv[:2] and kept[-1] == argv[-1] and "…[59969 more words]" in kept
    assert (
        started.attributes["argc"] == 60_001
        and started.attributes["argv_digest"] == command.attributes["argv_digest"]
    )


def test_many_env_names_are_cut_the_same_way() -> None:
    envs = {f"NAME_{n:06d}": "v" for n in range(20_000)}
    with capture_audit() as audit:
        with Sandbox.create(
            backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=_ran)), audit, run_id="r"), envs=envs
        ) as sbx:
            sbx.commands.run(["env"], envs=envs)
        (start,) = audit.of(EventKind.SANDBOX_START)
        (command,) = audit.of(EventKind.COMMAND)
    for event in (start, command):
        assert len(json.dumps(event.attributes)) < 2 * TEXT_CAP
        assert event.attributes["env_names_count"] == 20_000 and event.attributes["env_names_cut"] is True


def test_a_short_argv_is_kept_whole_without_a_digest() -> None:
    with capture_audit() as audit:
        with Sandbox.create(
            backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=_ran)), audit, run_id="r")
        ) as sbx:
            sbx.commands.run(["ls", "-la", "src"])
        (command,) = audit.of(EventKind.COMMAND)
    assert command.attributes["argv"] == ["ls", "-la", "src"] and "argv_digest" not in command.attributes


def test_one_call_s_execs_keep_to_one_budget_across_both_frames() -> None:
    """The execs judged between calls come in a frame of their own before the call's, each
    frame bounded by MAX_EXEC_REPORT (768 KiB): together 89 exec events of 1,299 KiB for one
    command. Now the call's exec events keep to 768 KiB together, the rest counted, and what
    the rules stopped keeps its room whatever the allowed ones took."""
    word = "x" * 1000

    def judged(n: int, *, between: bool, verdict: str = "allow") -> ExecRecord:
        return ExecRecord(
            path="/bin/true", argv=("true", str(n), *[word] * 15), verdict=verdict, between=between
        )

    execs = (
        *(judged(n, between=True) for n in range(45)),
        *(judged(n, between=False) for n in range(45)),
        judged(99, between=False, verdict="deny"),
    )

    def ran(op: RunCommand) -> CommandResult:
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0, execs=execs, execs_omitted=3)

    with capture_audit() as audit:
        with Sandbox.create(
            backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=ran)), audit, run_id="r")
        ) as sbx:
            sbx.commands.run(["sh", "-c", "true"])
        events = audit.of(EventKind.EXEC)
    *kept, counted = events
    assert sum(len(json.dumps(e.attributes)) for e in kept) <= 768 * 1024
    assert counted.attributes["verdict"] == "omitted"
    assert len(kept) + int(str(counted.attributes["count"])) == len(execs) + 3
    assert kept[-1].attributes["verdict"] == "deny"


def test_an_exec_judged_inside_keeps_its_argv_within_the_cap() -> None:
    """An exec's argv is what the sandbox reported, which the host does not trust to have kept
    to 32 KiB: it was kept word by word, and 64 words of 4,096 characters made an event of
    262 KB. It is cut as a command's is."""
    words = tuple(f"{n:04d}" + "a" * 4092 for n in range(64))
    judged = ExecRecord(path="/usr/bin/true", argv=("true", *words), verdict="allow")

    def ran(op: RunCommand) -> CommandResult:
        return CommandResult(exit_code=0, stdout="", stderr="", duration_s=0, execs=(judged,))

    with capture_audit() as audit:
        with Sandbox.create(
            backend=AuditedBackend(FakeBackend(MemoryWorkspace(commands=ran)), audit, run_id="r")
        ) as sbx:
            sbx.commands.run(["sh", "-c", "true"])
        (exec_event,) = audit.of(EventKind.EXEC)
    assert len(json.dumps(exec_event.attributes)) < 2 * TEXT_CAP
    assert exec_event.attributes["argv_count"] == 65
    assert (
        exec_event.attributes["argv_digest"]
        == "sha256:"
        + hashlib.sha256(json.dumps(["true", *words], separators=(",", ":")).encode()).hexdigest()
    )
