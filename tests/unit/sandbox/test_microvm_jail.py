"""QEMU's jail (``_microvm_jail``), around small programs instead of QEMU: the capabilities
left, and the RAM file opened for reading by the preloaded library (a QEMU in it:
tests/integration/test_microvm_tier.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.sandbox._microvm_jail import QemuJail, ram_shim
from tests.conftest import require

PYTHON = "/usr/bin/python3"
DAC_OVERRIDE = 1 << 1
# What the jailed program says: the access mode it got the RAM file with, or the error.
OPEN_RDWR = (
    "import fcntl, os, sys\n"
    "try:\n"
    "    fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "except OSError as err:\n"
    "    print(err.strerror)\n"
    "else:\n"
    "    print(['read', 'write', 'read-write'][fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE])\n"
)


@pytest.fixture
def jail() -> QemuJail:
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    usable = (
        os.geteuid() == 0 and bwrap is not None and setpriv is not None and sys.platform.startswith("linux")
    )
    require("QEMU's jail", usable, "the microvm tier's: root, bubblewrap and setpriv")
    assert bwrap is not None and setpriv is not None
    return QemuJail(bwrap, setpriv)


def _caps(jail: QemuJail, *, private_ram: Path | None = None, shim: Path | None = None) -> dict[str, int]:
    argv = jail.wrap(
        ["/usr/bin/grep", "^Cap", "/proc/self/status"], read=(), private_ram=private_ram, shim=shim
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {key: int(value, 16) for key, value in (line.split(":") for line in out.splitlines())}


def _ram_file(tmp_path: Path) -> Path:
    ram = tmp_path / "ram"
    ram.write_bytes(b"\0" * 4096)
    ram.chmod(0o400)  # as the snapshot store keeps its objects
    return ram


def test_the_jailed_program_holds_no_capability_and_can_regain_none(jail: QemuJail) -> None:
    assert set(_caps(jail).values()) == {0}


# Every file of /proc the jailed program may open for writing, but its own process's.
WRITABLE_PROC = (
    "import os\n"
    "for top, dirs, files in os.walk('/proc'):\n"
    "    parts = top.split('/')\n"
    "    if len(parts) > 2 and (parts[2].isdigit() or parts[2] in ('self', 'thread-self')):\n"
    "        dirs[:] = []\n"
    "        continue\n"
    "    for name in files:\n"
    "        try:\n"
    "            os.close(os.open(os.path.join(top, name), os.O_WRONLY))\n"
    "        except OSError:\n"
    "            continue\n"
    "        print(os.path.join(top, name))\n"
)


def test_the_jailed_program_can_change_no_setting_of_the_hosts_kernel(jail: QemuJail) -> None:
    """QEMU runs as uid 0 in its jail, and a sysctl's write needs nothing more: an escaped
    QEMU could write 785 files of /proc, kernel.core_pattern among them (a program the host's
    kernel runs as root on the next crash), fs.file-max, vm.drop_caches (found from outside)."""
    argv = jail.wrap([PYTHON, "-c", WRITABLE_PROC], read=())
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == [], done.stdout[:2000]


def test_the_ram_file_is_opened_for_reading_through_a_read_only_mount(jail: QemuJail, tmp_path: Path) -> None:
    shim = ram_shim(tmp_path / "native")
    require(
        "QEMU's RAM shim", shim is not None and Path(PYTHON).is_file(), "no C compiler, or no system python3"
    )
    ram = _ram_file(tmp_path)
    argv = jail.wrap([PYTHON, "-c", OPEN_RDWR, str(ram)], read=(), private_ram=ram, shim=shim)
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout == "read\n"
    # Any other file is opened as asked: the root image, mounted read-only, refuses writing.
    other = tmp_path / "other"
    other.write_bytes(b"x")
    argv = jail.wrap([PYTHON, "-c", OPEN_RDWR, str(other)], read=(other,), private_ram=ram, shim=shim)
    said = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert said == "Read-only file system\n"
    assert set(_caps(jail, private_ram=ram, shim=shim).values()) == {0}


def test_without_the_library_the_ram_file_costs_dac_override_alone(jail: QemuJail, tmp_path: Path) -> None:
    ram = _ram_file(tmp_path)
    caps = _caps(jail, private_ram=ram)
    assert caps["CapEff"] == caps["CapBnd"] == caps["CapPrm"] == DAC_OVERRIDE
