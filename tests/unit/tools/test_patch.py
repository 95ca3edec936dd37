"""apply_patch: unified diffs applied all or nothing, with a clear report of the failing hunk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stockade import Sandbox
from stockade.exceptions import PatchRejected
from stockade.testing import FakeBackend
from stockade.tools.patch import apply_patch_to_sandbox, apply_to_text, parse_unified_diff

ORIGINAL = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return w + h\n"


@pytest.fixture
def sbx() -> Sandbox:
    sandbox = Sandbox.create(backend=FakeBackend())
    sandbox.files.write("shapes.py", ORIGINAL)
    sandbox.files.write("notes.txt", "keep me\n")
    return sandbox


def test_a_hunk_replaces_lines_in_place(sbx: Sandbox) -> None:
    diff = (
        "--- a/shapes.py\n+++ b/shapes.py\n@@ -5,2 +5,2 @@\n"
        " def perimeter(w, h):\n-    return w + h\n+    return 2 * (w + h)\n"
    )
    assert apply_patch_to_sandbox(sbx, diff) == [("shapes.py", 1, 1)]
    assert sbx.files.read("shapes.py").endswith("    return 2 * (w + h)\n")


def test_a_hunk_whose_line_numbers_are_off_is_found_nearby() -> None:
    [patch] = parse_unified_diff(
        "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n def perimeter(w, h):\n-    return w + h\n+    return 0\n"
    )
    assert apply_to_text(ORIGINAL, patch).endswith("    return 0\n")


def test_a_failing_hunk_changes_no_file_and_says_which_and_why(sbx: Sandbox) -> None:
    diff = (
        "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-keep me\n+changed\n"
        "--- a/shapes.py\n+++ b/shapes.py\n"
        "@@ -1,2 +1,2 @@\n def area(w, h):\n-    return w * h\n+    return h * w\n"
        "@@ -5,2 +5,2 @@\n def perimeter(w, h):\n-    return w - h\n+    return 2 * (w + h)\n"
    )
    with pytest.raises(PatchRejected) as caught:
        apply_patch_to_sandbox(sbx, diff)
    assert caught.value.path == "shapes.py" and caught.value.hunk == 2
    assert "hunk 2 of 2 for shapes.py" in str(caught.value)
    assert "'    return w - h'" in str(caught.value) and "'    return w + h'" in str(caught.value)
    assert sbx.files.read("notes.txt") == "keep me\n"  # the first file was not touched either
    assert sbx.files.read("shapes.py") == ORIGINAL


def test_dev_null_creates_and_deletes_files(sbx: Sandbox) -> None:
    diff = (
        "--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
        "--- a/notes.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-keep me\n"
    )
    apply_patch_to_sandbox(sbx, diff)
    assert sbx.files.read("pkg/new.py") == "x = 1\ny = 2\n"
    assert not sbx.files.exists("notes.txt")


def test_gits_header_of_an_empty_file_creates_and_deletes_it(sbx: Sandbox) -> None:
    """git shows an empty file created or deleted by its header alone (no hunk): the run's diff
    does too, and apply_patch takes it back; a file with text is not deleted that way."""
    sbx.files.write("old_empty", b"")
    diff = (
        "diff --git a/pkg/__init__.py b/pkg/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n"
        "diff --git a/old_empty b/old_empty\ndeleted file mode 100644\nindex e69de29..0000000\n"
    )
    assert [(p.old_path, p.new_path, p.hunks) for p in parse_unified_diff(diff)] == [
        (None, "pkg/__init__.py", ()),
        ("old_empty", None, ()),
    ]
    apply_patch_to_sandbox(sbx, diff)
    assert sbx.files.read("pkg/__init__.py") == "" and not sbx.files.exists("old_empty")
    with pytest.raises(PatchRejected, match=r"deletes notes\.txt but leaves text in it"):
        apply_patch_to_sandbox(sbx, "diff --git a/notes.txt b/notes.txt\ndeleted file mode 100644\n")
    assert sbx.files.read("notes.txt") == "keep me\n"
    with_lines = (
        "diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n@@ -0,0 +1 @@\n+x\n"
    )
    apply_patch_to_sandbox(sbx, with_lines)  # a git header before lines: read as any diff
    assert sbx.files.read("n.py") == "x\n"


def test_no_newline_at_end_of_file_is_respected() -> None:
    [patch] = parse_unified_diff("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n\\ No newline at end of file\n")
    assert apply_to_text("a\n", patch) == "b"


def test_a_blank_context_line_without_its_space_is_accepted() -> None:
    [patch] = parse_unified_diff("--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n\n-c\n+C\n")
    assert apply_to_text("a\n\nc\n", patch) == "a\n\nC\n"


def test_text_that_is_not_a_diff_is_refused_with_the_expected_shape() -> None:
    with pytest.raises(PatchRejected, match="no unified diff found"):
        parse_unified_diff("please change line 3")


def test_patching_a_missing_file_is_refused(sbx: Sandbox) -> None:
    with pytest.raises(PatchRejected, match="no such file"):
        apply_patch_to_sandbox(sbx, "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n")


# Hunks found nowhere, in files that repeat their lines: the search compared the whole hunk at
# every place of the file, O(file x hunk) of host CPU (the first took minutes, the second hours,
# and no deadline or kill stopped the thread). Each now ends in about a second with PatchRejected.
_HOSTILE = textwrap.dedent(
    """
    import time
    from stockade.exceptions import PatchRejected
    from stockade.tools.patch import apply_to_text, parse_unified_diff

    blank = "\\n" * 200_000
    nowhere = "--- a/f\\n+++ b/f\\n@@ -1 +1 @@\\n" + "\\n" * 20_000 + " z\\n+q\\n"
    repeats = ("a\\n" + "\\n" * 999) * 2000
    everywhere = (
        "--- a/f\\n+++ b/f\\n@@ -5 +5 @@\\n" + " \\n" * 500 + " a\\n" + " \\n" * 1500 + " a\\n"
        + " \\n" * 120_000 + "+q\\n"
    )
    for text, diff in ((blank, nowhere), (repeats, everywhere)):
        started = time.monotonic()
        try:
            apply_to_text(text, parse_unified_diff(diff)[0])
        except PatchRejected as err:
            print(round(time.monotonic() - started, 1), str(err)[:60])
    """
)


def test_a_hunk_in_a_file_of_repeated_lines_is_rejected_in_bounded_time() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _HOSTILE], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    nowhere, everywhere = done.stdout.splitlines()
    assert "does not apply" in nowhere
    assert "could not be placed" in everywhere  # over MAX_SEARCH_WORK: a typed refusal, not hours
    assert all(float(line.split()[0]) < 10 for line in (nowhere, everywhere))


def test_a_moved_hunk_is_found_at_the_nearest_place_exact_before_loose() -> None:
    text = "m\n" * 7 + "a\nb \n" + "m\n" * 5 + "a\nb\n"
    [patch] = parse_unified_diff("--- a/f\n+++ b/f\n@@ -9,2 +9,2 @@\n a\n-b\n+B\n")
    lines = apply_to_text(text, patch).split("\n")
    assert lines.index("B") == 15  # the exact match 6 lines on, not the loose one 1 line before
