"""How the supervisor unpacks a snapshot's object streamed in chunks (``supervisor/unpack.py``):
staged, and moved into place only at the commit; a stream that fails or is aborted midway
leaves nothing of it; a file that does not fit is refused at its header, before its data."""

from __future__ import annotations

import errno
import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from stockade._globs import unpack_filter
from stockade.sandbox._requests import VCS_FOLDERS, upload_entries
from stockade.types import SandboxRules
from tests.unit.sandbox.supervisor_modules import supervisor_module

CHUNK = 64 << 10


unpack = supervisor_module("unpack")
fileops = supervisor_module("fileops")


def archive(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def stream(root: Path, data: bytes, *, end: str = "commit") -> None:
    """Send ``data`` as the host does: open, a chunk at a time, then ``end``."""
    area = fileops.Workspace(str(root))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    for start in range(0, len(data), CHUNK):
        unpack.handle(area, {"stage": "append", "tx": tx}, data[start : start + CHUNK])
    unpack.handle(area, {"stage": end, "tx": tx}, b"")


def tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def test_a_committed_stream_is_in_place_merged_with_what_was_there(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "old").write_bytes(b"kept")
    (tmp_path / "notes").write_bytes(b"replaced")
    big = os.urandom(3 * CHUNK + 5)
    stream(tmp_path, archive({"pkg/new": b"n", "notes": b"restored", "big": big}))
    assert tree(tmp_path) == {
        "big": big,
        "notes": b"restored",
        "pkg": None,
        "pkg/new": b"n",
        "pkg/old": b"kept",
    }


def test_a_stream_aborted_midway_leaves_nothing(tmp_path: Path) -> None:
    """The host aborts when the object did not hash to its name: what came is dropped."""
    (tmp_path / "there").write_bytes(b"before")
    data = archive({"a": os.urandom(5 * CHUNK), "b": b"b"})
    area = fileops.Workspace(str(tmp_path))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    for start in range(0, len(data), CHUNK):
        unpack.handle(area, {"stage": "append", "tx": tx}, data[start : start + CHUNK])
    unpack.handle(area, {"stage": "abort", "tx": tx}, b"")
    assert tree(tmp_path) == {"there": b"before"}


def test_a_malformed_archive_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    # The first header's checksum fails. (A later header that does ends tarfile's archive
    # there, quietly: only the host's hash of the whole object tells that one.)
    data = bytearray(archive({"a": os.urandom(2 * CHUNK), "b": b"b"}))
    data[100] ^= 0xFF
    with pytest.raises(tarfile.TarError):
        stream(tmp_path, bytes(data))
    assert tree(tmp_path) == {}


def test_a_file_larger_than_the_room_is_refused_at_its_header(tmp_path: Path) -> None:
    """The room is the destination's free space: a member past it is refused before its data
    comes, with the first chunk, not after the whole of it was sent."""
    room = os.statvfs(tmp_path)
    free = room.f_bavail * room.f_frsize
    header = tarfile.TarInfo("huge")
    header.size = free + (1 << 40)  # past the room however much other tests free meanwhile
    first = header.tobuf(tarfile.PAX_FORMAT) + bytes(CHUNK)  # its header and a little data
    area = fileops.Workspace(str(tmp_path))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    with pytest.raises(fileops.PathRefused, match=r"'huge' is .* bytes free") as refused:
        unpack.handle(area, {"stage": "append", "tx": tx}, first)
        unpack.handle(area, {"stage": "commit", "tx": tx}, b"")
    assert refused.value.kind == "full"
    assert tree(tmp_path) == {}


def restore(root: Path, data: bytes, keep: dict[str, object] | None = None) -> dict[str, Any]:
    """Send ``data`` as a restore does, with what the rules let in (``keep``): the commit's reply."""
    area = fileops.Workspace(str(root))
    opening: dict[str, object] = {"stage": "open", "path": "", **({"keep": keep} if keep else {})}
    tx = unpack.handle(area, opening, b"")["tx"]
    for start in range(0, len(data), CHUNK):
        unpack.handle(area, {"stage": "append", "tx": tx}, data[start : start + CHUNK])
    reply: dict[str, Any] = unpack.handle(area, {"stage": "commit", "tx": tx}, b"")
    return reply


def test_fifos_sockets_and_devices_are_left_out_and_named(tmp_path: Path) -> None:
    """The supervisor sends a socket as a bare header of its own type ``s``: tarfile made it an
    empty executable file. None is workspace content: each is left out, named as a download names it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("kept.txt"), io.BytesIO(b""))
        for name, kind in (("sock", b"s"), ("fifo", tarfile.FIFOTYPE), ("tty", tarfile.CHRTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, 0o755
            tar.addfile(info)
    reply = restore(tmp_path, buf.getvalue())
    assert tree(tmp_path) == {"kept.txt": b""}
    assert reply["skipped"] == [
        {"path": "sock", "kind": "socket"},
        {"path": "fifo", "kind": "fifo"},
        {"path": "tty", "kind": "char device"},
    ]


def test_what_the_rules_hide_never_enters_nor_its_other_names(tmp_path: Path) -> None:
    """A folder hidden with what it holds, by a wildcard too (``secret*`` covers ``secrets/``),
    a repository's store by its name, and a further name of a hidden file (the same file)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        files = {"secrets/key": b"TOP", "secretx/k": b"X", ".git/config": b"g", "app.py": b"a"}
        for name, data in files.items():
            tar.addfile(_sized(name, data), io.BytesIO(data))
        alias = tarfile.TarInfo("alias")
        alias.type, alias.linkname = tarfile.LNKTYPE, "secrets/key"
        tar.addfile(alias)
    keep = unpack_filter(SandboxRules(hide=("secret*",)).hide, ("**",), {".git"})
    restore(tmp_path, buf.getvalue(), keep)
    assert tree(tmp_path) == {"app.py": b"a"}


def _sized(name: str, data: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


@pytest.mark.parametrize(
    "rules",
    [
        SandboxRules(hide=("secrets/**",)),
        SandboxRules(hide=("secrets",)),
        SandboxRules(hide=("**/*.pem", "data/raw")),
        SandboxRules(read=("src/**", "README.md")),
        SandboxRules(read=("src/*.py", "docs"), hide=("src/secret.py",)),
        SandboxRules(read=("**/*.md",)),
    ],
    ids=lambda r: f"hide={','.join(r.hide)} read={','.join(r.read)}",
)
def test_a_restore_keeps_what_an_upload_of_the_same_tree_keeps(tmp_path: Path, rules: SandboxRules) -> None:
    """The unpacking matches the rules as the host's upload walk does (``upload_entries``):
    the same tree, restored under the rules, is what an upload under them would bring."""
    source = tmp_path / "source"
    for name in ("src/app.py", "src/secret.py", "src/deep/x.py", "secrets/key", "docs/a.md", "README.md",
                 "data/raw/1.csv", "data/cert.pem", "notes.txt", ".git/HEAD"):  # fmt: skip
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(source.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(source)), recursive=False)
    dest = tmp_path / "dest"
    dest.mkdir()
    restore(dest, buf.getvalue(), unpack_filter(rules.hide, rules.read, {".git", *VCS_FOLDERS}))
    uploaded = {name for _, name, _ in upload_entries(source, rules.hide, rules.read)[0]}
    assert set(tree(dest)) == uploaded


def test_no_proc_path_opens_the_channel_an_upload_streams_through(tmp_path: Path) -> None:
    """On gVisor code opens any descriptor of the supervisor's through /proc/1/fd/N, a pipe's
    either end: it could read an upload, add to it, or keep a reader of its own and leave the
    supervisor's write blocked for good. The chunks go through a unix socket pair, which no
    /proc path opens (ENXIO, as here)."""
    area = fileops.Workspace(str(tmp_path))
    tx = unpack.handle(area, {"stage": "open", "path": ""}, b"")["tx"]
    try:
        with pytest.raises(OSError) as refused:
            os.close(os.open(f"/proc/self/fd/{unpack._transfers[tx].write_fd}", os.O_RDONLY | os.O_NONBLOCK))
        assert refused.value.errno == errno.ENXIO
    finally:
        unpack.handle(area, {"stage": "abort", "tx": tx}, b"")
