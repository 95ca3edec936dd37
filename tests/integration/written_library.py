"""A shared object that says when its code ran, as code in a sandbox could write one (for the
tests that a file the code wrote never runs, loaded by a listed program or not)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import require

SOURCE = r"""
#include <unistd.h>
__attribute__((constructor)) static void ran(void) { write(1, "RAN-A-WRITTEN-LIBRARY\n", 22); }
"""


@pytest.fixture(scope="module")
def written_library(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The library's bytes, built by the host's C compiler."""
    require("a C compiler (gcc)", shutil.which("gcc") is not None)
    folder = tmp_path_factory.mktemp("library")
    (folder / "x.c").write_text(SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "x.so"), str(folder / "x.c")], check=True)
    return (folder / "x.so").read_bytes()
