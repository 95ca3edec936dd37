"""apply_patch: unified diffs applied all or nothing, with a clear report of the failing hunk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade import Sandbox
from stockade.exceptions import PatchRejected, StockadeError
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools.patch import apply_patch_to_sandbox, apply_to_text, parse_unified_diff, patch_ops

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


@pytest.mark.parametrize("mark", ["\f", "\v", "\x1c", "\x85", "\u2028", "\u2029", "\r"])
def test_a_line_holding_a_character_other_splitters_end_lines_at_is_one_line(mark: str) -> None:
    """Lines end at \\n: a form feed or a Unicode line separator in a line is its content."""
    original = f"x = 1\nlabel = 'a{mark}b'\n"
    [patch] = parse_unified_diff(f"--- a/f\n+++ b/f\n@@ -2 +2 @@\n-label = 'a{mark}b'\n+label = 'a{mark}c'\n")
    assert apply_to_text(original, patch) == f"x = 1\nlabel = 'a{mark}c'\n"


def test_a_diff_with_crlf_line_ends_reads_as_one_with_lf() -> None:
    [patch] = parse_unified_diff("--- a/f\r\n+++ b/f\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n")
    assert apply_to_text("a\n", patch) == "b\n"


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


# Found by a hostile model driving apply_patch: "/dev/null" over "/dev/null" crashed the run with a
# bare AssertionError from the policy guard; a file named twice was applied twice, each part
# against the original, the last winning; a git binary patch created an empty file, "applied".
@pytest.mark.parametrize(
    ("diff", "said"),
    [
        ("--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+x\n", "both /dev/null"),
        ("--- a/\n+++ b/\n@@ -1 +1 @@\n-a\n+b\n", "names no file"),
        (
            "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-keep me\n+one\n"
            "--- /dev/null\n+++ b/tw\n@@ -0,0 +1 @@\n+one\n--- /dev/null\n+++ b/tw\n@@ -0,0 +1 @@\n+two\n",
            "patches tw twice",
        ),
        (
            "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-keep me\n+one\n"
            "--- a/./notes.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-keep me\n",
            "patches ./notes.txt twice",
        ),
        (
            "--- a/shapes.py\n+++ b/d/../notes.txt\n@@ -1 +1 @@\n def area(w, h):\n"
            "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-keep me\n+one\n",
            "patches notes.txt twice",
        ),
        (
            "diff --git a/b.bin b/b.bin\nnew file mode 100644\nindex 0000000..4a36ef7\n"
            "GIT binary patch\nliteral 3\nKcmZ>9%K-oab^sr`\n\nliteral 0\nHcmV?d00001\n\n",
            "binary patches are not supported",
        ),
        (
            "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-keep me\n+one\n"
            "diff --git a/b.bin b/b.bin\nindex 4a36ef7..0000001 100644\n"
            "Binary files a/b.bin and b/b.bin differ\n",
            "binary patches are not supported",
        ),
        ("--- a/notes.txt\n+++ b/notes.txt\n@@ -" + "9" * 5000 + " +1 @@\n-keep me\n+x\n", "malformed"),
    ],
    ids=["dev-null-twice", "no-name", "created-twice", "modified-then-deleted", "renamed-onto", "git-binary",
         "binary-differ", "huge-line-number"],
)  # fmt: skip
def test_a_diff_that_names_no_file_one_twice_or_a_binary_is_refused_whole(
    sbx: Sandbox, diff: str, said: str
) -> None:
    with pytest.raises(PatchRejected, match=said):
        patch_ops(diff)  # what the policy guard reads before the tool runs
    with pytest.raises(PatchRejected, match=said):
        apply_patch_to_sandbox(sbx, diff)
    assert sorted(e.path for e in sbx.files.list("")) == ["notes.txt", "shapes.py"]
    assert sbx.files.read("notes.txt") == "keep me\n" and sbx.files.read("shapes.py") == ORIGINAL


_NAMES = ["a/s", "s", "./s", "/dev/null", "a/", "b/t\tdate", "a/e", "../x"]
_HEADER = st.tuples(
    st.sampled_from(["0", "1", "2", "9" * 30, "\u0661"]),
    st.sampled_from(["", ",0", ",1", ",3"]),
    st.sampled_from(["0", "1", "2"]),
    st.sampled_from(["", ",0", ",1"]),
).map(lambda h: f"@@ -{h[0]}{h[1]} +{h[2]}{h[3]} @@")
_BODY = st.tuples(
    st.sampled_from([" ", "-", "+", "\\", ""]), st.sampled_from(["a", "b", "", " ", "\x0c"])
).map("".join)
_FILE = st.tuples(
    st.sampled_from(_NAMES),
    st.sampled_from(_NAMES),
    st.lists(st.tuples(_HEADER, st.lists(_BODY, max_size=4)), max_size=2),
).map(lambda f: [f"--- {f[0]}", f"+++ {f[1]}"] + [line for h, body in f[2] for line in (h, *body)])
_NOISE = st.one_of(
    st.sampled_from(["s", "e", "t", ""]).map(lambda n: f"diff --git a/{n} b/{n}"),
    st.sampled_from(
        ["new file mode 100644", "deleted file mode 100644", "index 0..e69", "GIT binary patch", "prose"]
    ),
    _HEADER,
    _BODY,
    st.text(max_size=8),
).map(lambda line: [line])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    diff=st.one_of(
        st.lists(st.one_of(_FILE, _NOISE), max_size=5).map(
            lambda parts: "\n".join(line for part in parts for line in part)
        ),
        st.text(max_size=60),
    ),
    original=st.sampled_from(["", "a\n", "a\nb\n", "a", " \n"]),
)
def test_any_text_is_a_diff_or_a_typed_refusal(diff: str, original: str) -> None:
    """Whatever the model sends as a diff: a parse, or ``PatchRejected``; applied, or refused
    typed (a path the workspace refuses is its own ``StockadeError``), never another error."""
    try:
        patches = parse_unified_diff(diff)
    except PatchRejected:
        return
    patch_ops(diff)
    for patch in patches:
        with contextlib.suppress(PatchRejected):
            apply_to_text(original, patch)
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sandbox:
        sandbox.files.write("s", original)
        sandbox.files.write("e", "")
        with contextlib.suppress(StockadeError):
            apply_patch_to_sandbox(sandbox, diff)
