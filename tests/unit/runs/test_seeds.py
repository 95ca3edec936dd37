"""A run's starting workspace is kept in the run store: packed identically for identical
folders (stored once), capped with a clear error, and unpacked to the same files."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from stockade import Sandbox
from stockade.agent import Agent
from stockade.exceptions import RunStoreError, SeedTooLarge
from stockade.runs import RunRecorder, RunStore, open_run_store
from stockade.runs.seeds import pack_workspace, unpack_seed
from stockade.testing import FakeBackend, ScriptedModel


def project(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("print('hello')\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    return root


def seeds_stored(store: RunStore) -> int:
    return int(str(store.db.query(f"SELECT COUNT(*) FROM {store.ns}_seeds")[0][0]))


def test_a_recorded_run_keeps_its_starting_workspace(store: RunStore, tmp_path: Path) -> None:
    workspace = project(tmp_path / "project")
    agent = Agent(ScriptedModel(["done"]), checkpointer=store, observers=[RunRecorder(store, seed=workspace)])
    with Sandbox.create(backend=FakeBackend()) as sbx:
        assert agent.run_sync("look", sandbox=sbx, run_id="r").ok

    restored = tmp_path / "restored"
    assert store.restore_seed("r", restored)
    assert (restored / "src" / "app.py").read_text() == "print('hello')\n"
    assert (restored / "run.sh").stat().st_mode & 0o111  # still executable
    assert not store.restore_seed("another-run", tmp_path / "nothing")


def test_identical_seeds_are_stored_once(store: RunStore, tmp_path: Path) -> None:
    first = project(tmp_path / "a")
    second = project(tmp_path / "b")  # same content, other folder, other times
    assert store.save_seed("r1", first) == store.save_seed("r2", second)
    assert seeds_stored(store) == 1
    (second / "src" / "app.py").write_text("print('changed')\n")
    store.save_seed("r3", second)
    assert seeds_stored(store) == 2


def test_a_workspace_over_the_cap_is_refused_with_what_to_do(tmp_path: Path) -> None:
    workspace = project(tmp_path / "project")
    (workspace / "data.bin").write_bytes(b"x" * 2048)
    with open_run_store("memory:") as store:
        store.max_seed_bytes = 1024
        with pytest.raises(SeedTooLarge, match="over the run store's seed cap of 1,024"):
            store.save_seed("r", workspace)
        assert seeds_stored(store) == 0


def test_packing_does_not_depend_on_times_or_owners(tmp_path: Path) -> None:
    workspace = project(tmp_path / "project")
    before = pack_workspace(workspace).digest
    os.utime(workspace / "src" / "app.py", (1, 1))
    assert pack_workspace(workspace).digest == before


def test_links_out_of_the_workspace_come_back_as_the_links_the_sandbox_got(tmp_path: Path) -> None:
    # a virtualenv's interpreter, a link to a sibling checkout: the upload sends them as they are
    workspace = project(tmp_path / "project")
    (workspace / ".venv" / "bin").mkdir(parents=True)
    (workspace / ".venv" / "bin" / "python").symlink_to("/usr/bin/python3")
    (workspace / "shared").symlink_to("../../shared-lib")
    (workspace / "app").symlink_to("src/app.py")

    restored = tmp_path / "restored"
    unpack_seed(pack_workspace(workspace).data, restored)
    assert os.readlink(restored / ".venv" / "bin" / "python") == "/usr/bin/python3"
    assert os.readlink(restored / "shared") == "../../shared-lib"
    assert (restored / "app").read_text() == "print('hello')\n"


def test_nothing_is_unpacked_through_a_link_out_of_the_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        link = tarfile.TarInfo("out")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        tar.addfile(link)
        planted = tarfile.TarInfo("out/planted")
        planted.size = 2
        tar.addfile(planted, io.BytesIO(b"hi"))
    with pytest.raises(RunStoreError, match="cannot be unpacked"):
        unpack_seed(gzip.compress(buffer.getvalue()), tmp_path / "restored")
    assert list(outside.iterdir()) == []


def test_a_seed_that_beats_tarfiles_filter_writes_nothing_outside_its_folder(tmp_path: Path) -> None:
    """A seed is the run's code's files: the link chain longer than PATH_MAX that got past
    tarfile's ``data`` filter (CVE-2025-4517) is refused, and nothing is written."""
    from tests.hostile_archives import escaping_tar

    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "flag").write_text("original\n")
    restored = tmp_path / "restored"
    with pytest.raises(RunStoreError, match="cannot be unpacked"):
        unpack_seed(gzip.compress(escaping_tar(restored)), restored)
    assert (tmp_path / "outside" / "flag").read_text() == "original\n"
    assert sorted(os.listdir(tmp_path / "outside")) == ["flag"]
    assert not restored.exists()
