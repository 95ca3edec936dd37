"""`stockade audit verify | export | tail` over a SQLite store."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stockade.audit import GENESIS, AuditLog, Chain, EventKind, SQLiteStore, canonical
from stockade.cli.main import app

runner = CliRunner()


def make_store(path: Path, events: int = 5, key: bytes | None = None) -> str:
    store = SQLiteStore(path)
    with AuditLog(store, key=key) as log:
        for step in range(events):
            run = "run-a" if step % 2 == 0 else "run-b"
            log.record(EventKind.COMMAND, run_id=run, step=step, attributes={"argv": ["ls"]})
    store.close()
    return f"sqlite:///{path}"


def test_verify_says_intact_and_exits_zero(tmp_path: Path) -> None:
    result = runner.invoke(app, ["audit", "verify", "--db", make_store(tmp_path / "a.db")])
    assert result.exit_code == 0, result.output
    assert "intact" in result.output


def test_verify_names_the_tampered_event_and_exits_one(tmp_path: Path) -> None:
    db = make_store(tmp_path / "a.db")
    with sqlite3.connect(tmp_path / "a.db") as conn:
        conn.execute("DROP TRIGGER audit_events_no_update")
        conn.execute("UPDATE audit_events SET body = replace(body, 'ls', 'rm') WHERE seq = 3")

    result = runner.invoke(app, ["audit", "verify", "--db", db, "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["problems"] == [
        {"seq": 3, "kind": "edited", "detail": "the event's content does not match its hash"}
    ]


def test_verify_with_the_key_from_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    db = make_store(tmp_path / "a.db", key=b"0123456789abcdef0123456789abcdef")

    assert runner.invoke(app, ["audit", "verify", "--db", db, "--key-file", str(key_file)]).exit_code == 0
    assert runner.invoke(app, ["audit", "verify", "--db", db]).exit_code == 1


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r\n"])
def test_a_key_file_is_its_bytes_less_one_line_ending(tmp_path: Path, ending: bytes) -> None:
    """The key file was stripped of all whitespace: a random key that began or ended with a
    space or a tab (about one in 20 of 32 bytes) was another key, and a genuine trail failed."""
    key = b" \tkey-0123456789abcdef\x0b\n\t"
    (tmp_path / "key").write_bytes(key + ending)
    db = make_store(tmp_path / "a.db", key=key)

    result = runner.invoke(app, ["audit", "verify", "--db", db, "--key-file", str(tmp_path / "key")])
    assert result.exit_code == 0 and "intact" in result.output, result.output


def test_a_key_file_that_holds_no_key_is_refused(tmp_path: Path) -> None:
    """An empty key file was no key: a keyed trail was checked as an unkeyed one."""
    (tmp_path / "key").write_bytes(b"\n")
    db = make_store(tmp_path / "a.db", key=b"0123456789abcdef")

    result = runner.invoke(app, ["audit", "verify", "--db", db, "--key-file", str(tmp_path / "key")])
    assert result.exit_code == 2 and "holds no key" in result.output, result.output


def test_a_trail_rewritten_without_its_key_is_downgraded_for_the_keys_holder(tmp_path: Path) -> None:
    """The head said sha256 and verify with the key said: "pass no key (it is not keyed)"."""
    key = b"0123456789abcdef0123456789abcdef"
    (tmp_path / "key").write_bytes(key)
    db = make_store(tmp_path / "a.db", key=key)
    plain = Chain()
    with sqlite3.connect(tmp_path / "a.db") as conn:  # an attacker who can write the file
        conn.execute("DROP TRIGGER audit_events_no_update")
        prev = GENESIS
        for seq, body in conn.execute("SELECT seq, body FROM audit_events ORDER BY seq").fetchall():
            forged = canonical({**json.loads(body), "prev_hash": prev})
            prev = plain.link(prev, forged)
            conn.execute(
                "UPDATE audit_events SET body = ?, hash = ? WHERE seq = ?", (forged.decode(), prev, seq)
            )
        mac = plain.head_mac(5, prev, "audit")
        conn.execute("UPDATE audit_head SET hash = ?, algorithm = 'sha256', mac = ?", (prev, mac))
    assert runner.invoke(app, ["audit", "verify", "--db", db]).exit_code == 0  # unkeyed: proves nothing

    result = runner.invoke(
        app, ["audit", "verify", "--db", db, "--key-file", str(tmp_path / "key"), "--json"]
    )
    assert result.exit_code == 1, result.output
    assert [p["kind"] for p in json.loads(result.output)["problems"]] == ["downgraded"]
    assert "no key" not in result.output


def test_export_writes_one_json_event_per_line(tmp_path: Path) -> None:
    db = make_store(tmp_path / "a.db")
    result = runner.invoke(app, ["audit", "export", "--db", db, "--run", "run-a", "--format", "jsonl"])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.output.splitlines()]
    assert [e["seq"] for e in events] == [1, 3, 5]
    assert all(e["run_id"] == "run-a" and len(e["hash"]) == 64 for e in events)


def test_an_export_of_an_argv_of_bytes_that_are_no_utf8_is_whole_and_utf8(tmp_path: Path) -> None:
    """Code ran `true b'\\xff'`: its exec record holds a lone surrogate. The export to a file
    stopped at that event with a UnicodeEncodeError; to stdout it wrote the raw byte."""
    store = SQLiteStore(tmp_path / "a.db")
    with AuditLog(store) as log:
        log.record(
            EventKind.EXEC,
            run_id="run-a",
            attributes={"argv": ["true", b"\xff".decode(errors="surrogateescape")]},
        )
        log.record(EventKind.COMMAND, run_id="run-a", step=1, attributes={"argv": ["ls"]})
    store.close()
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["audit", "export", "--db", f"sqlite:///{tmp_path / 'a.db'}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in out.read_bytes().decode("utf-8").splitlines()]
    assert [e["seq"] for e in events] == [1, 2]
    assert events[0]["attributes"]["argv"] == ["true", "\udcff"]


@pytest.mark.parametrize("named", ["itself", "symlink", "hard link", "its -wal", "its -shm"])
def test_an_export_never_writes_over_the_database_it_reads(tmp_path: Path, named: str) -> None:
    """`audit export -o audit.db` emptied the file before reading it: a 204,800-byte trail of
    12 events (and the run store sharing the file) became 0 bytes, and the export failed."""
    path = tmp_path / "a.db"
    db = make_store(path)
    before = path.read_bytes()
    output = {
        "itself": path,
        "symlink": tmp_path / "link.jsonl",
        "hard link": tmp_path / "hard.jsonl",
        "its -wal": tmp_path / "a.db-wal",
        "its -shm": tmp_path / "a.db-shm",
    }[named]
    if named == "symlink":
        output.symlink_to(path)
    elif named == "hard link":
        os.link(path, output)

    result = runner.invoke(app, ["audit", "export", "--db", db, "-o", str(output)])
    assert result.exit_code == 2, result.output
    assert "is the audit database" in result.output
    assert path.read_bytes() == before
    assert runner.invoke(app, ["audit", "verify", "--db", db]).exit_code == 0


def test_an_export_replaces_its_output_only_when_done_and_writes_through_a_symlink(tmp_path: Path) -> None:
    db = make_store(tmp_path / "a.db")
    target = tmp_path / "siem" / "events.jsonl"
    target.parent.mkdir()
    target.write_text("yesterday's export\n")
    target.chmod(0o640)
    link = tmp_path / "latest.jsonl"
    link.symlink_to(target)

    result = runner.invoke(app, ["audit", "export", "--db", db, "-o", str(link)])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and [json.loads(line)["seq"] for line in target.read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert target.stat().st_mode & 0o777 == 0o640  # the owner's choice, kept
    assert os.listdir(target.parent) == ["events.jsonl"]  # no temporary file left behind


def test_tail_prints_the_last_events(tmp_path: Path) -> None:
    result = runner.invoke(app, ["audit", "tail", "--db", make_store(tmp_path / "a.db"), "-n", "2"])
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.splitlines()] == ["4", "5"]


def test_tail_and_export_show_what_code_wrote_as_escapes_in_json_that_reads_the_same(tmp_path: Path) -> None:
    """A file the code wrote was named `A<CSI>2J<CSI>31mRED<DEL><RLO>B`: `audit tail` printed the
    8-bit CSI (U+009B), which xterm acts on, DEL and the bidi override raw."""
    name = "A\x9b2J\x9b31mRED\x7f\u202eB\u200bC\U000e0041"
    store = SQLiteStore(tmp_path / "a.db")
    with AuditLog(store) as log:
        log.record(EventKind.FILE_WRITE, run_id="run-a", actor="code\u202e", attributes={"path": name})
    store.close()
    db = f"sqlite:///{tmp_path / 'a.db'}"
    raw = {chr(c) for c in (*range(0x7F, 0xA0), 0x202E, 0x200B, 0xE0041)}
    tail = runner.invoke(app, ["audit", "tail", "--db", db])
    assert tail.exit_code == 0, tail.output
    assert not set(tail.output) & raw
    assert '"path":"A\\u009b2J\\u009b31mRED\\u007f\\u202eB\\u200bC\\udb40\\udc41"' in tail.output
    assert "code\\u202e" in tail.output
    assert json.loads(tail.output[tail.output.index("{") :]) == {"path": name}  # the same JSON
    export = runner.invoke(app, ["audit", "export", "--db", db])
    assert export.exit_code == 0 and not set(export.output) & raw
    assert json.loads(export.output)["attributes"] == {"path": name}


def test_a_missing_store_is_an_error_not_a_new_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["audit", "verify", "--db", str(tmp_path / "none.db")])
    assert result.exit_code == 2
    assert not (tmp_path / "none.db").exists()


def test_verify_reports_a_body_that_is_not_an_event_and_goes_on(tmp_path: Path) -> None:
    db = make_store(tmp_path / "a.db")
    with sqlite3.connect(tmp_path / "a.db") as conn:
        conn.execute("DROP TRIGGER audit_events_no_update")
        conn.execute("UPDATE audit_events SET body = 'not json at all' WHERE seq = 2")
        conn.execute("UPDATE audit_events SET body = '[2, 3]' WHERE seq = 4")  # JSON, not an event

    result = runner.invoke(app, ["audit", "verify", "--db", db, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    # each unreadable event is one finding; the events after it still verify against its hash
    assert report["problems"] == [
        {"seq": 2, "kind": "unreadable", "detail": "the body is not an audit event"},
        {"seq": 4, "kind": "unreadable", "detail": "the body is not an audit event"},
    ]
    assert report["checked"] == 5


def test_nothing_found_is_not_intact(tmp_path: Path) -> None:
    db = make_store(tmp_path / "a.db")
    typo = runner.invoke(app, ["audit", "verify", "--db", db, "--run", "run-typo"])
    assert typo.exit_code == 2 and "intact" not in typo.output
    assert "no events of run run-typo" in typo.output
    as_json = json.loads(
        runner.invoke(app, ["audit", "verify", "--db", db, "--run", "run-typo", "--json"]).stdout
    )
    assert as_json["ok"] is False and as_json["found"] is False
    assert runner.invoke(app, ["audit", "verify", "--db", db, "--run", "run-a"]).exit_code == 0

    empty = make_store(tmp_path / "empty.db", events=0)
    result = runner.invoke(app, ["audit", "verify", "--db", empty])
    assert result.exit_code == 2 and "the audit trail is empty" in result.output

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    result = runner.invoke(app, ["audit", "verify", "--db", f"sqlite:///{other}"])
    assert result.exit_code == 2 and "holds no audit trail" in result.output
    with sqlite3.connect(other) as conn:  # and verifying did not create one in it
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"notes"}


def test_a_store_that_cannot_be_read_is_neither_intact_nor_absent(tmp_path: Path) -> None:
    """A store on a full disk (or damaged, or locked) was reported as holding no trail, exit 2:
    what a monitor takes for "no trail yet". It cannot be read: exit 3, and why."""
    path = tmp_path / "a.db"
    db = make_store(path)
    with path.open("r+b") as damaged:  # the schema's page, past the file's header
        damaged.seek(100)
        damaged.write(b"\xff" * 200)
    result = runner.invoke(app, ["audit", "verify", "--db", db])
    assert result.exit_code == 3, result.output
    assert "cannot read" in result.output and "holds no audit trail" not in result.output

    not_a_database = tmp_path / "notes.txt"
    not_a_database.write_text("a text file, no database " * 100)
    result = runner.invoke(app, ["audit", "verify", "--db", f"sqlite:///{not_a_database}"])
    assert result.exit_code == 2 and "holds no audit trail" in result.output


def edit(path: Path, statement: str) -> None:
    """Change the store the way someone with the file would: raw SQL, the guard dropped."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TRIGGER IF EXISTS audit_events_no_update")
        conn.execute(statement)


def test_verify_does_not_write_to_the_store_it_checks(tmp_path: Path) -> None:
    """Opening the store ran its schema script: verify put a deleted head record back (and
    would have made every missing table)."""
    path = tmp_path / "a.db"
    db = make_store(path)
    edit(path, "DELETE FROM audit_head")
    result = runner.invoke(app, ["audit", "verify", "--db", db, "--json"])
    assert result.exit_code == 1, result.output
    assert [p["kind"] for p in json.loads(result.output)["problems"]] == ["head_forged"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM audit_head").fetchone() == (0,)

    edit(path, "DROP TABLE audit_head")  # a damaged store: unreadable, and left as it is
    for command in ("verify", "tail"):  # (export reads no head: it has what it needs)
        result = runner.invoke(app, ["audit", command, "--db", db])
        assert result.exit_code == 3, (command, result.output)
        assert "no such table: audit_head" in result.output
    with sqlite3.connect(path) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"audit_events", "audit_run_keys"}


@pytest.mark.parametrize(
    ("statement", "why"),
    [
        ("UPDATE audit_events SET body = 'not json' WHERE seq = 3", "JSONDecodeError"),
        ("UPDATE audit_events SET body = replace(body, '\"command\"', '\"nosuch\"') WHERE seq = 3", "nosuch"),
    ],
    ids=["not-json", "unknown-kind"],
)
def test_tail_and_export_stop_at_an_edited_event_and_say_where(
    tmp_path: Path, statement: str, why: str
) -> None:
    """They crashed with a bare JSONDecodeError or ValueError; the export ended cut, unsaid."""
    path = tmp_path / "a.db"
    db = make_store(path)
    edit(path, statement)

    out = tmp_path / "out.jsonl"
    export = runner.invoke(app, ["audit", "export", "--db", db, "-o", str(out)])
    assert export.exit_code == 1, export.output
    assert "stopped after seq 2 (2 events exported)" in export.output
    assert "seq 3 is not a readable audit event" in export.output and why in export.output
    assert [json.loads(line)["seq"] for line in out.read_text().splitlines()] == [1, 2]

    tail = runner.invoke(app, ["audit", "tail", "--db", db])
    assert tail.exit_code == 1, tail.output
    assert [line.split()[0] for line in tail.stdout.splitlines()] == ["1", "2"]
    assert "seq 3 is not a readable audit event" in tail.output


def test_export_of_a_sealed_value_that_does_not_open_says_which_event(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    with SQLiteStore(path) as store, AuditLog(store, flush_interval_s=None) as log:
        log.seal_run("run-a", "alice")
        log.record(EventKind.COMMAND, run_id="run-a", attributes={"argv": ["cat", "notes"]})
        log.record(EventKind.COMMAND, run_id="run-a", step=1, attributes={"argv": ["ls"]})
    edit(
        path,
        'UPDATE audit_events SET body = replace(body, \'"$sealed":"\', \'"$sealed":"AAAA\') WHERE seq = 2',
    )

    result = runner.invoke(app, ["audit", "export", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert "stopped after seq 1 (1 events exported)" in result.output
    assert "seq 2: a sealed event of run 'run-a' does not open" in result.output


def test_numbers_past_what_a_seq_can_be_are_said_not_raised(tmp_path: Path) -> None:
    """Found from outside: OverflowError and ValueError tracebacks for a seq of 23 digits or a
    negative count."""
    db = make_store(tmp_path / "a.db")
    huge = "99999999999999999999999"
    assert runner.invoke(app, ["audit", "tail", "--db", db, "-n", "-3"]).exit_code == 2
    pinned = runner.invoke(app, ["audit", "verify", "--db", db, "--expect-head", f"{huge}:abc"])
    assert pinned.exit_code == 2 and "SEQ:HASH" in pinned.output
    for after in (huge, f"-{huge}"):
        exported = runner.invoke(app, ["audit", "export", "--db", db, "--after", after])
        assert exported.exit_code == 0, exported.output
        assert len(exported.output.splitlines()) == (0 if after == huge else 5)


# A child whose files cannot grow past 30,000 bytes: SQLite's shared-memory file (32 KiB) then
# cannot, as on a full disk, while the store is made.
_OPEN_FULL = """
import resource, signal, sys
from stockade import exceptions
from stockade.audit import SQLiteStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))
try:
    SQLiteStore(sys.argv[1])
except exceptions.StockadeError as error:
    print(type(error).__name__, error.retryable)
"""


def test_a_store_that_cannot_be_made_is_a_store_error_and_verify_says_so(tmp_path: Path) -> None:
    """Opening a SQLite store on a full disk raised a bare ``sqlite3.OperationalError`` (from
    making its tables, outside the store's errors) and could leave part of its tables made."""
    path = tmp_path / "a.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, "-c", _OPEN_FULL, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.stdout.split() == ["AuditStoreError", "True"], child.stderr
    with contextlib.closing(
        sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    ) as db:  # all its tables, or none
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables in (set(), {"audit_events", "audit_head", "audit_run_keys"})
    result = runner.invoke(app, ["audit", "verify", "--db", f"sqlite:///{path}"])
    assert result.exit_code != 0, result.output
