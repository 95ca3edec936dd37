"""Data classes over whole folders: a download, a listing to a depth, a recursive removal and an
archive put reach every path beneath their folder, so a class's own folder and each folder above
it (``reports`` and the root, for ``reports/**``) hold the class. Before, such an op was judged
by its folder's own path: a download or a put of the root went past the class's rules."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from stockade._globs import reaches
from stockade.policy.engine import PolicyEngine
from stockade.policy.schema import Policy, Verdict
from stockade.sandbox.ops import GetArchive, HostFolder, ListDir, Op, PutArchive, Remove

# ``analyst`` may read and write the class with read_file alone; ``clerk`` may read it with any
# tool and write none of it; ``intern`` may do neither (the class is kept out of its sandboxes).
POLICY = Policy.model_validate(
    {
        "data": [{"paths": ["reports/**"], "tier": "confidential"}],
        "data_access": {"confidential": {"read": ["analyst", "clerk"], "write": ["analyst"]}},
        "roles": {
            "analyst": {"tools": ["read_file", "list_files", "write_file"]},
            "clerk": {"tools": ["read_file", "list_files", "write_file"]},
            "intern": {"tools": ["read_file", "list_files", "write_file"]},
        },
    }
)
KEPT_TO_READ_FILE = Policy.model_validate(
    {
        **POLICY.model_dump(mode="json", exclude_defaults=True),
        "data_access": {
            "confidential": {"read": ["analyst", "clerk"], "write": ["analyst"], "tools": ["read_file"]}
        },
    }
)


def rule(role: str, op: Op[object], tool: str, policy: Policy = POLICY) -> str | None:
    """The rule that refuses ``op`` (None: allowed)."""
    decision = PolicyEngine(policy, role=role).op(op, tool=tool)
    return None if decision.verdict is Verdict.ALLOW else decision.rule


def tar_of(*names: str) -> bytes:
    held = io.BytesIO()
    with tarfile.open(fileobj=held, mode="w") as tar:
        for name in names:
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    return held.getvalue()


@pytest.mark.parametrize(
    ("folder", "depth", "reached"),
    [
        ("reports", 1, True),  # the class's folder: its entries are the class's
        ("reports/2024", 1, True),  # inside it
        ("", None, True),  # the root, all the way down
        ("", 2, True),  # reports/2024 is two levels down
        ("", 1, False),  # the folder reports itself holds no file of the class
        ("src", None, False),  # an unrelated folder
        ("report", None, False),  # a name that only starts alike
    ],
)
def test_a_folder_reaches_the_class_its_glob_lies_beneath(
    folder: str, depth: int | None, reached: bool
) -> None:
    assert reaches(["reports/**"], folder, depth) is reached


def test_a_glob_without_wildcards_is_reached_at_its_own_name_and_one_without_a_folder_everywhere() -> None:
    assert reaches(["secrets"], "", 1)
    assert not reaches(["secrets/key.pem"], "", 1)
    assert reaches(["secrets/key.pem"], "", 2)
    assert reaches(["**/*.pem"], "src", 1)


@pytest.mark.parametrize("folder", ["", ".", "reports", "/workspace"])
def test_a_download_over_the_class_needs_the_class_and_its_tools(folder: str) -> None:
    op = GetArchive(path=folder)
    assert rule("analyst", op, "read_file") is None
    assert rule("analyst", op, "read_file", KEPT_TO_READ_FILE) is None
    assert rule("analyst", op, "shell", KEPT_TO_READ_FILE) == "data_access.confidential.tools"
    assert rule("analyst", GetArchive(path="src"), "shell", KEPT_TO_READ_FILE) is None  # unrelated


def test_a_listing_reaches_the_class_at_the_depth_its_files_lie() -> None:
    assert rule("analyst", ListDir(path="", depth=1), "list_files", KEPT_TO_READ_FILE) is None
    for op in (ListDir(path="", depth=2), ListDir(path="reports", depth=1)):
        assert rule("analyst", op, "list_files", KEPT_TO_READ_FILE) == "data_access.confidential.tools"
        assert rule("analyst", op, "list_files") is None


def test_a_role_whose_sandboxes_hold_none_of_the_class_downloads_and_lists_the_whole_workspace() -> None:
    """The class is kept out of the intern's sandboxes (``sandbox_rules``); refusing a download
    of the root would only refuse the workspace, which holds none of the class."""
    assert "reports/**" in PolicyEngine(POLICY, role="intern").sandbox_rules().hide
    assert rule("intern", GetArchive(path=""), "read_file") is None
    assert rule("intern", ListDir(path="", depth=32), "list_files") is None
    assert rule("intern", GetArchive(path="reports/2024"), "read_file") == "data_access.confidential.read"


@pytest.mark.parametrize("folder", ["", "reports"])
def test_removing_a_folder_that_holds_the_class_needs_its_write(folder: str) -> None:
    op = Remove(path=folder or ".")
    assert rule("clerk", op, "write_file") == "data_access.confidential.write"  # its files stay
    assert rule("analyst", op, "write_file") is None
    assert rule("analyst", op, "write_file", KEPT_TO_READ_FILE) == "data_access.confidential.tools"
    assert rule("clerk", Remove(path="src"), "write_file") is None
    assert rule("clerk", Remove(path=folder or ".", recursive=False), "write_file") is None  # an empty one


@pytest.mark.parametrize(
    ("folder", "names"),
    [("", ("notes.txt", "reports/q4.txt")), ("reports", ("q4.txt",)), (".", ("./reports/2024/",))],
)
def test_an_archive_put_is_judged_by_each_file_it_writes(folder: str, names: tuple[str, ...]) -> None:
    op = PutArchive(path=folder, data=tar_of(*names))
    assert rule("intern", op, "write_file") == "data_access.confidential.write"
    assert rule("clerk", op, "write_file") == "data_access.confidential.write"
    assert rule("analyst", op, "write_file", KEPT_TO_READ_FILE) == "data_access.confidential.tools"
    assert rule("analyst", op, "write_file") is None


def test_an_archive_put_beside_the_class_is_allowed_at_the_root() -> None:
    op = PutArchive(path="", data=tar_of("notes.txt", "src/app.py", "reports"))  # the folder alone
    assert rule("intern", op, "write_file") is None


def test_a_host_folder_put_is_judged_by_the_names_its_tar_holds(tmp_path: Path) -> None:
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "q4.txt").write_text("Q4: 0")
    (tmp_path / "notes.txt").write_text("notes")
    whole = PutArchive(path="", folder=HostFolder(source=tmp_path))
    assert rule("intern", whole, "write_file") == "data_access.confidential.write"
    hidden = PutArchive(path="", folder=HostFolder(source=tmp_path, hide=("reports/**",)))
    assert rule("intern", hidden, "write_file") is None  # what the walk leaves out is not sent


def test_an_archive_the_host_cannot_read_is_judged_for_every_class_beneath_its_folder() -> None:
    op = PutArchive(path="", data=b"not a tar")
    assert rule("intern", op, "write_file") == "data_access.confidential.write"
    assert rule("intern", PutArchive(path="src", data=b"not a tar"), "write_file") is None
