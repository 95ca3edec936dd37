"""A forked child inherits its parent's sandboxes as objects, not as sandboxes: its exit left
them to the finalizers it inherited, which killed the parent's sandboxes and leased pool
members ("the supervisor exited"), and a call it made wrote into the parent's channel, got a
made-up timeout 10 s later and killed the sandbox too. And a request whose send was cut (a
Ctrl-C mid-``files.write``) left half a frame on the wire: the next call was a made-up
timeout, 10 s later, for a command that never ran."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from stockade import Sandbox
from stockade.exceptions import SandboxClosed

CHILD = Path(__file__).with_name("fork_child.py")
ROOT = Path(__file__).resolve().parents[2]


def test_a_forked_child_leaves_its_parents_sandboxes_alone(tier: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, str(CHILD), tier]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["after_exit"] == ["hi\n", "hi\n"]  # the child's exit killed neither
    for tried in report["child_use"]:  # the child's call is refused at once, typed
        assert tried["error"] == "SandboxClosed", tried
        assert "a fork" in tried["said"]
        assert tried["seconds"] < 1
    assert report["after_use"] == ["hi\n", "hi\n"]  # and the parent's go on


class _Interrupt:
    """SIGALRM every 2 ms; the first that lands where ``at`` says, by the main thread's
    innermost frames, raises ``KeyboardInterrupt`` there, as a Ctrl-C would (the others do
    nothing)."""

    def __init__(self, at: Callable[[list[FrameType]], bool]) -> None:
        self.at = at
        self.fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        frames: list[FrameType] = []
        while frame is not None and len(frames) < 6:
            frames.append(frame)
            frame = frame.f_back
        if self.fired or not self.at(frames):
            return
        self.fired = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    def write(self, sbx: Sandbox) -> None:
        """A write of six chunks, again until one is interrupted where ``at`` says."""
        data = os.urandom(24 << 20)
        before = signal.signal(signal.SIGALRM, self)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
            for _ in range(20):
                try:
                    sbx.files.write("big.bin", data)
                except KeyboardInterrupt:
                    break
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        assert self.fired


def test_a_send_cut_short_closes_the_sandbox_at_its_next_call(tier: str) -> None:
    with Sandbox.create(tier) as sbx:
        _Interrupt(_mid_send).write(sbx)  # mid-request
        started = time.monotonic()
        with pytest.raises(SandboxClosed, match=r"send of a (write|ping) request was interrupted"):
            sbx.commands.run("echo ok", timeout_s=1)
        assert time.monotonic() - started < 3  # at once, not after a made-up timeout
        assert not sbx.alive


def test_a_write_interrupted_between_its_requests_leaves_no_partial_file(tier: str) -> None:
    with Sandbox.create(tier) as sbx:
        # waiting for the answer to a chunk (the partial file named: the open was answered)
        _Interrupt(
            lambda frames: (
                _names(frames)[:2] == ["frames", "result"]
                and any(f.f_code.co_name == "write" and "tmp" in f.f_locals for f in frames)
            )
        ).write(sbx)
        _whole_or_none(sbx)  # and the sandbox goes on


def _names(frames: list[FrameType]) -> list[str]:
    return [f.f_code.co_name for f in frames]


def _mid_send(frames: list[FrameType]) -> bool:
    """In a stream's send (or the loop that waits for room in it) of a request's frame."""
    names = _names(frames)
    return names[0] in ("send", "send_all") and "call" in names


def test_a_write_interrupted_while_its_first_chunk_is_answered_leaves_no_partial_file(tier: str) -> None:
    with Sandbox.create(tier) as sbx:
        # the open made the temporary file, its answer (which named it) not read yet
        _Interrupt(
            lambda frames: (
                _names(frames)[:2] == ["frames", "result"]
                and any(
                    f.f_code.co_name == "write" and "args" in f.f_locals and "start" not in f.f_locals
                    for f in frames
                )
            )
        ).write(sbx)
        _whole_or_none(sbx)


def _whole_or_none(sbx: Sandbox) -> None:
    """No temporary file left; the file a write before the interrupted one made, whole, or none
    (a write the timer missed completes: the loop goes on until one is interrupted)."""
    assert sbx.commands.run("ls -A /workspace").stdout in ("", "big.bin\n")
    assert sbx.commands.run("stat -c %s big.bin || echo 25165824").stdout.split()[-1] == str(24 << 20)
