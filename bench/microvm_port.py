"""What one virtio-serial port of the microVM carries, raw: the ceiling of its egress.

    python bench/microvm_port.py [--mb 64] [--runs 3]

The microVM's egress crosses a virtio-serial port (``stockade.egress._mux``), as every byte
between the host and its supervisor does. This boots the tier's guest (its QEMU command
line, TCG, kernel and virtio devices: ``bench/microvm_boot.py``'s raw initramfs) with an init
that moves ``--mb`` MiB through the port each way, once with busybox ``dd``/``head`` (the
port's own ceiling under this emulation) and once with the guest's python3 moving 256 KiB
writes and 1 MiB reads (the ceiling of a relay written in Python, like the supervisor's),
and times it on the host from the first byte to the last. Prints a markdown table (medians).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from microvm_boot import raw_initrd

from stockade.sandbox import microvm
from stockade.sandbox.base import SandboxSpec

# Each step says "R" when it is ready, sends SIZE bytes, reads SIZE bytes, then says "K".
BUSYBOX = (
    "exec 5<>/dev/$port && echo R >&5 && $B dd if=/dev/zero bs=65536 count=COUNT >&5 2>/dev/null && "
    "$B head -c SIZE <&5 > /dev/null && echo K >&5"
)
# No quotes, dollars or backslashes: it goes into the init script in double quotes.
PYTHON_CODE = """
import os, sys
p = os.open(sys.argv[1], os.O_RDWR)
os.write(p, bytes([82, 10]))
size = SIZE
chunk = bytes(256 * 1024)
sent = 0
while sent < size: sent += os.write(p, chunk[: size - sent])
got = 0
READ
os.write(p, bytes([75, 10]))
"""
READS = {
    "os.read": "while got < size: got += len(os.read(p, 1 << 20))",
    "readinto": (
        "import io\nf = io.FileIO(p, closefd=False)\nview = memoryview(bytearray(1 << 20))\n"
        "while got < size: got += f.readinto(view)"
    ),
}
PYTHON = (
    "$B mount -t ext4 -o ro,noload /dev/vda /newroot && $B mount -t devtmpfs dev /newroot/dev && "
    '$B chroot /newroot /usr/bin/python3 -c "{code}" /dev/$port'
)


def _read_exactly(sock: socket.socket, size: int) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while size > 0:
        got = sock.recv_into(view[: min(len(buf), size)])
        if not got:
            raise RuntimeError("the guest closed its port early")
        size -= got


def transfer(
    backend: microvm.MicroVMBackend, image: Path, initrd: Path, workdir: Path, size: int
) -> tuple[float, float]:
    """(guest to host, host to guest) in MB/s."""
    mine, theirs = socket.socketpair()
    argv = backend._argv(SandboxSpec(), "bench", files=(image, initrd), fd=theirs.fileno(), rundir=workdir)
    proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    theirs.close()
    mine.settimeout(180)
    try:
        _read_exactly(mine, 2)  # "R\n": booted
        start = time.perf_counter()
        _read_exactly(mine, size)
        out = size / (time.perf_counter() - start) / 1e6
        data = bytes(1 << 20)
        start = time.perf_counter()
        left = size
        while left > 0:
            left -= mine.send(data[: min(len(data), left)])
        _read_exactly(mine, 2)  # "K\n": the guest has read it all
        back = size / (time.perf_counter() - start) / 1e6
        return out, back
    except Exception:
        console = workdir / "console.log"
        print(console.read_text(errors="replace")[-1500:] if console.exists() else "", file=sys.stderr)
        raise
    finally:
        proc.kill()
        proc.wait()
        mine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    size = args.mb * 1024 * 1024
    backend = microvm.MicroVMBackend()
    image, _ = backend.prepare()
    assert backend.kernel is not None
    steps = {
        "busybox dd / head": BUSYBOX.replace("COUNT", str(size // 65536)).replace("SIZE", str(size)),
        **{
            f"python3 os.write / {name}": PYTHON.format(
                code=PYTHON_CODE.replace("SIZE", str(size)).replace("READ", read)
            )
            for name, read in READS.items()
        },
    }
    load = [os.getloadavg()[0]]
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        initrds = {
            name: raw_initrd(backend.kernel, workdir, step, backend.busybox) for name, step in steps.items()
        }
        for _ in range(args.runs):  # interleaved
            for name in steps:
                rows[name].append(transfer(backend, image, initrds[name], workdir, size))
                load.append(os.getloadavg()[0])
    print(f"virtio-serial port of the microVM ({backend.accel}), {args.mb} MiB each way, {args.runs} runs, "
          f"load average {min(load):.1f}-{max(load):.1f}\n")  # fmt: skip
    print("| in the guest | guest to host | host to guest |")
    print("|---|---|---|")
    for name, values in rows.items():
        out = statistics.median(v[0] for v in values)
        back = statistics.median(v[1] for v in values)
        print(f"| {name} | {out:.0f} MB/s | {back:.0f} MB/s |")


if __name__ == "__main__":
    main()
