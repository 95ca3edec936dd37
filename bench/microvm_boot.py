"""Cold start and latency of the microVM tier, against raw QEMU boots of the same kernel.

    python bench/microvm_boot.py [--runs N]

Measured in one run, interleaved (drift hits every row alike), with the very QEMU command
line the tier uses (microvm machine, TCG, the same kernel, root image and virtio devices):
* raw boot: an initramfs of busybox and the virtio modules whose init writes one byte to the
  virtio-serial port: QEMU start to that byte on the host;
* raw boot + python: the same init also mounts the root image and runs
  ``python3 -c 'print(1)'`` from it into the port (what the tier's start must at least do);
* stockade: ``Sandbox.create("microvm")`` + ``run_code("print(1)")`` (create + first output);
* ``run_code("print(1)")`` and ``commands.run(["true"])`` p50 on a live sandbox.
Prints a markdown table (medians).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stockade import Sandbox
from stockade.sandbox import _microvm_image, microvm
from stockade.sandbox.base import SandboxSpec

RAW_INIT = """\
#!/bin/busybox sh
B=/bin/busybox
$B mount -t devtmpfs dev /dev
$B mount -t sysfs sys /sys
for m in MODULES; do $B insmod /lib/modules/$m.ko; done
port=""
while [ -z "$port" ]; do
  for f in /sys/class/virtio-ports/*/name; do
    [ "$($B cat "$f" 2>/dev/null)" = stockade ] && port=${f%/name} && port=${port##*/}
  done
  [ -n "$port" ] || $B usleep 1000
done
while [ ! -e /dev/vda ]; do $B usleep 1000; done
STEP
$B poweroff -f
"""
JUST_BOOT = "echo up > /dev/$port"
WITH_PYTHON = (
    "$B mount -t ext4 -o ro,noload /dev/vda /newroot && $B mount -t proc proc /newroot/proc && "
    "$B chroot /newroot /usr/bin/python3 -c 'print(1)' > /dev/$port"
)


def raw_initrd(kernel: _microvm_image.GuestKernel, workdir: Path, step: str, busybox: str) -> Path:
    init = RAW_INIT.replace("MODULES", " ".join(_microvm_image.MODULES)).replace("STEP", step)
    entries: list[tuple[str, int, bytes]] = [
        (d, 0o040755, b"") for d in ("bin", "dev", "sys", "lib", "lib/modules", "newroot")
    ]
    entries.append(("init", 0o100755, init.encode()))
    entries.append(("bin/busybox", 0o100755, Path(busybox).read_bytes()))
    for name in _microvm_image.MODULES:
        data = (kernel.modules / "kernel" / _microvm_image.MODULE_PATHS[name]).read_bytes()
        entries.append((f"lib/modules/{name}.ko", 0o100644, data))
    path = workdir / f"raw-{abs(hash(step))}.cpio"
    path.write_bytes(_microvm_image._cpio(entries))
    return path


def raw_boot(
    backend: microvm.MicroVMBackend, image: Path, initrd: Path, workdir: Path
) -> Callable[[], object]:
    def run() -> None:
        mine, theirs = socket.socketpair()
        argv = backend._argv(
            SandboxSpec(), "bench", files=(image, initrd), fd=theirs.fileno(), rundir=workdir
        )
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        mine.settimeout(60)
        try:
            if not mine.recv(16):
                raise RuntimeError("the raw guest sent nothing")
        finally:
            proc.kill()
            proc.wait()
            mine.close()

    return run


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    backend = microvm.MicroVMBackend()
    image, _ = backend.prepare()
    assert backend.kernel is not None
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        boot = raw_boot(
            backend, image, raw_initrd(backend.kernel, workdir, JUST_BOOT, backend.busybox), workdir
        )
        with_python = raw_boot(
            backend, image, raw_initrd(backend.kernel, workdir, WITH_PYTHON, backend.busybox), workdir
        )
        rows: dict[str, list[float]] = {"boot": [], "python": [], "create": [], "close": []}
        for _ in range(args.runs):
            rows["boot"].append(timed(boot))
            rows["python"].append(timed(with_python))
            start = time.perf_counter()
            sbx = Sandbox.create("microvm")
            sbx.run_code("print(1)")
            rows["create"].append(time.perf_counter() - start)
            rows["close"].append(timed(sbx.close))
    with Sandbox.create("microvm") as sbx:
        sbx.run_code("print(1)")
        code = [timed(lambda: sbx.run_code("print(1)")) for _ in range(30)]
        true = [timed(lambda: sbx.commands.run(["true"])) for _ in range(30)]
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"microVM tier, QEMU microvm ({backend.accel}), kernel {backend.kernel.version}, {args.runs} runs\n"
    )
    print("| measurement | value | ratio |")
    print("|---|---|---|")
    boot, python, create = med["boot"], med["python"], med["create"]
    print(f"| raw QEMU boot to a byte on the port | {boot:.2f} s | 1.00x |")
    print(f"| raw boot + mount root image + python3 print(1) | {python:.2f} s | {python / boot:.2f}x |")
    print(f"| stockade create + run_code print(1) | {create:.2f} s | {create / boot:.2f}x |")
    print(f"| ... against raw boot + python | | {create / python:.2f}x |")
    print(f"| close | {med['close'] * 1000:.1f} ms | |")
    print(f"| run_code('print(1)') on a live sandbox, p50 | {statistics.median(code) * 1000:.2f} ms | |")
    print(f"| commands.run(['true']) on a live sandbox, p50 | {statistics.median(true) * 1000:.2f} ms | |")


if __name__ == "__main__":
    main()
