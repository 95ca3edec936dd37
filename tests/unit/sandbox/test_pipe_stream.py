"""A sandbox's pipes as the host's stream: once closed, it never reaches the pipes of the
sandbox started next, whose descriptors take the numbers the first one's had."""

from __future__ import annotations

import os
import subprocess

import pytest

from stockade.sandbox._host import PipeStream


def test_a_closed_stream_never_reads_nor_writes_the_pipes_that_take_its_numbers() -> None:
    first = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert first.stdin is not None and first.stdout is not None
    stream = PipeStream(first)
    stream.send(b"ping")
    assert stream.recv() == b"ping"
    numbers = first.stdin.fileno(), first.stdout.fileno()
    next_in_r, next_in_w = os.pipe()  # the next sandbox's pipes
    next_out_r, next_out_w = os.pipe()
    stream.close()  # as a sandbox's teardown does, while its reader is between two reads
    first.stdout.close()
    assert first.wait(timeout=10) == 0
    # The next sandbox's pipes take the numbers the first one's had (the kernel gives the
    # lowest free ones).
    os.dup2(next_in_w, numbers[0])
    os.dup2(next_out_r, numbers[1])
    try:
        os.write(next_out_w, b"ready")
        assert stream.recv() == b""  # the first stream's end, not the next sandbox's answer
        with pytest.raises(BrokenPipeError):  # a call after the close: the channel's crash
            stream.send(b"a call after the close")
        for end in (next_in_w, numbers[0]):
            os.close(end)
        assert os.read(next_in_r, 100) == b""  # nothing reached the next sandbox
        assert os.read(next_out_r, 100) == b"ready"  # its answer is still there for its reader
    finally:
        for fd in (next_in_r, next_out_r, next_out_w, numbers[1]):
            os.close(fd)


def test_a_stream_frees_its_descriptors_once_closed_and_read_to_its_end() -> None:
    # Not at the garbage collector's leisure: fifty sandboxes would hold a hundred pipes.
    before = set(os.listdir("/proc/self/fd"))
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    stream = PipeStream(proc)  # alive to the end: freed by itself, not by its collection
    stream.close()
    assert stream.recv() == b""
    proc.stdout.close()
    assert proc.wait(timeout=10) == 0
    assert set(os.listdir("/proc/self/fd")) == before
