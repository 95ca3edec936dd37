"""Audit trail speed: append rate, verification of a 1,000,000-event chain, sandbox overhead.

    python bench/audit.py [--events 1000000] [--commands 200]

Prints a markdown table. Each figure is set against the raw mechanism measured in the
same run: plain SQLite inserts of the same rows, a bare pass over the rows, and the same
sandbox command without auditing.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from stockade.audit import AuditedInstance, AuditLog, EventKind, SQLiteStore, verify
from stockade.sandbox import _registry
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import RunCommand

ATTRIBUTES = {"tool": "run_code", "args": {"code": "print(1)"}, "exit_code": 0, "stdout_bytes": 2}


def append_rate(directory: Path, events: int) -> tuple[float, float]:
    """(audited events/s, raw SQLite rows/s) for ``events`` tool-call events."""
    store = SQLiteStore(directory / "append.db")
    log = AuditLog(store, flush_interval_s=None)
    start = time.perf_counter()
    for step in range(events):
        log.record(
            EventKind.TOOL_CALL,
            run_id="run-1",
            step=step,
            actor="agent",
            duration_s=0.01,
            attributes=ATTRIBUTES,
        )
    log.close()
    audited = events / (time.perf_counter() - start)
    store.close()

    raw = sqlite3.connect(directory / "raw.db", isolation_level=None)
    raw.execute("PRAGMA journal_mode=WAL")
    raw.execute("PRAGMA synchronous=NORMAL")
    raw.execute("CREATE TABLE t (seq INTEGER PRIMARY KEY, run_id TEXT, kind TEXT, body TEXT)")
    start = time.perf_counter()
    batch = []
    for step in range(events):
        batch.append((step + 1, "run-1", "tool_call", json.dumps({"step": step, **ATTRIBUTES})))
        if len(batch) == 512:
            raw.execute("BEGIN")
            raw.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", batch)
            raw.execute("COMMIT")
            batch.clear()
    raw.execute("BEGIN")
    raw.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", batch)
    raw.execute("COMMIT")
    raw_rate = events / (time.perf_counter() - start)
    raw.close()
    return audited, raw_rate


def verify_time(directory: Path, events: int) -> tuple[float, float]:
    """(seconds to verify, seconds to merely read every row) for a chain of ``events``."""
    store = SQLiteStore(directory / "verify.db")
    log = AuditLog(store, batch_size=4096, flush_interval_s=None)
    for step in range(events):
        log.record(EventKind.COMMAND, run_id=f"run-{step // 1000}", step=step, attributes=ATTRIBUTES)
    log.close()
    start = time.perf_counter()
    report = verify(store)
    verified = time.perf_counter() - start
    assert report.ok and report.checked == events, report.problems[:3]
    start = time.perf_counter()
    for _ in store.rows():
        pass
    read = time.perf_counter() - start
    store.close()
    return verified, read


def sandbox_overhead(directory: Path, commands: int) -> tuple[float, float] | None:
    """(median seconds of a plain ``true``, of an audited one) on the process tier, interleaved."""
    if not _registry.probe("process").available:
        return None
    instance = _registry.backend("process").start(SandboxSpec())
    store = SQLiteStore(directory / "sandbox.db")
    log = AuditLog(store)
    audited = AuditedInstance(instance, log, run_id="bench")
    op = RunCommand(argv=("true",))
    plain_times, audited_times = [], []
    try:
        for _ in range(5):  # warm up
            instance.execute(op)
            audited.execute(op)
        for _ in range(commands):
            start = time.perf_counter()
            instance.execute(op)
            plain_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            audited.execute(op)
            audited_times.append(time.perf_counter() - start)
    finally:
        log.close()
        instance.close()
        store.close()
    return statistics.median(plain_times), statistics.median(audited_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000, help="length of the chain to verify")
    parser.add_argument("--append", type=int, default=200_000, help="events for the append rate")
    parser.add_argument("--commands", type=int, default=200, help="sandbox commands per variant")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        audited, raw = append_rate(directory, args.append)
        verified, read = verify_time(directory, args.events)
        overhead = sandbox_overhead(directory, args.commands)

    print("| measure | stockade | raw mechanism (same run) | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| append to SQLite ({args.append:,} events) | {audited:,.0f} events/s | {raw:,.0f} rows/s "
        f"(plain inserts) | {raw / audited:.2f}x slower | >= 20,000 events/s |"
    )
    print(
        f"| verify a {args.events:,}-event chain | {verified:.2f} s | {read:.2f} s (read rows only) "
        f"| {verified / read:.2f}x | < 10 s |"
    )
    if overhead is None:
        print("| audited sandbox command | process tier unavailable | | | < 5% |")
    else:
        plain, with_audit = overhead
        print(
            f"| audited `true` on the process tier (median of {args.commands}) | {with_audit * 1e3:.2f} ms "
            f"| {plain * 1e3:.2f} ms (unaudited) | {100 * (with_audit / plain - 1):+.1f}% | < 5% |"
        )


if __name__ == "__main__":
    main()
