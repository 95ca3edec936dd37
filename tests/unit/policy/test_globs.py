"""Workspace globs are taken in one form: a spelling that names the right files keeps them out
(of the sandbox's seed, and of a read_file), and one that cannot name the workspace's files is
refused where it is given, not matched against nothing."""

from __future__ import annotations

import fnmatch
import io
import tarfile
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import exceptions as exc
from stockade._globs import glob_matches
from stockade._state import within
from stockade.policy.engine import PolicyEngine
from stockade.policy.load import parse_policy
from stockade.sandbox._requests import tar_directory, upload_op
from stockade.sandbox.ops import ReadFile, WriteFile
from stockade.types import SandboxRules

NFC_NAME = unicodedata.normalize("NFC", "données")
NFD_NAME = unicodedata.normalize("NFD", "données")
NFC_CAFE = unicodedata.normalize("NFC", "café")
NFD_CAFE = unicodedata.normalize("NFD", "café")

# deny glob -> the file it keeps out (the finding: each of these hid nothing)
SPELLINGS = {
    "./secrets/**": "secrets/key",
    "/workspace/secrets/**": "secrets/key",
    "secrets//key": "secrets/key",
    "secrets/./key": "secrets/key",
    "/workspace//secrets/": "secrets/key",
    "[s]ecrets/**": "secrets/key",
    "[.]env": ".env",
    f"{NFC_NAME}/**": f"{NFD_NAME}/f.txt",  # a folder named in NFD (macOS), the glob in NFC
    f"{NFD_CAFE}/**": f"{NFC_CAFE}/f.txt",  # and the other way round
}


def workspace(root: Path) -> Path:
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print('hi')\n")
    for name in ("secrets/key", ".env", f"{NFD_NAME}/f.txt", f"{NFC_CAFE}/f.txt"):
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(f"TOPSECRET {unicodedata.normalize('NFC', name)}\n")
    return root


def sent(root: Path, hide: tuple[str, ...], read: tuple[str, ...] = ("**",)) -> dict[str, bytes]:
    """What an upload of ``root`` sends, name by name, its globs taken as ``upload_op`` takes them."""
    folder = upload_op(root, "/workspace", hide, read).folder
    assert folder is not None
    with tarfile.open(fileobj=io.BytesIO(tar_directory(folder.source, folder.hide, folder.read))) as tar:
        return {m.name: tar.extractfile(m).read() if m.isreg() else b"" for m in tar.getmembers()}  # type: ignore[union-attr]


def policy(deny: str) -> PolicyEngine:
    return PolicyEngine(parse_policy(f"[paths]\ndeny = [{_toml(deny)}]\n"))


def _toml(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.parametrize("glob", list(SPELLINGS))
def test_a_deny_glob_in_any_spelling_keeps_its_file_out_of_the_seed_and_read_file(
    tmp_path: Path, glob: str
) -> None:
    root, kept_out = workspace(tmp_path), SPELLINGS[glob]
    engine = policy(glob)
    names = sent(root, engine.sandbox_rules().hide)
    assert unicodedata.normalize("NFC", kept_out) not in {unicodedata.normalize("NFC", n) for n in names}
    # nor under another name (an NFD name that is the NFC one)
    assert f"TOPSECRET {unicodedata.normalize('NFC', kept_out)}\n".encode() not in names.values()
    assert "src/app.py" in names
    for path in (kept_out, f"/workspace/{kept_out}", unicodedata.normalize("NFD", kept_out)):
        assert not engine.op(ReadFile(path=path)).allowed, path
    assert engine.op(ReadFile(path="src/app.py")).allowed


@pytest.mark.parametrize("glob", list(SPELLINGS))
def test_sandbox_rules_and_an_upload_take_the_spellings_too(tmp_path: Path, glob: str) -> None:
    root, kept_out = workspace(tmp_path), SPELLINGS[glob]
    rules = SandboxRules(hide=(glob,), read=("./**",), write=("/workspace/src/**",))
    assert rules.write == ("src/**",) and rules.read == ("**",)
    for hide in (rules.hide, (glob,)):  # SandboxRules', and upload_dir's as given
        names = {unicodedata.normalize("NFC", n) for n in sent(root, hide)}
        assert unicodedata.normalize("NFC", kept_out) not in names and "src/app.py" in names


def test_read_globs_and_data_classes_are_taken_alike(tmp_path: Path) -> None:
    root = workspace(tmp_path)
    assert set(sent(root, (), ("/workspace/src/**", f"./{NFC_NAME}/*"))) == {
        "src", "src/app.py", NFD_NAME, f"{NFD_NAME}/f.txt"
    }  # fmt: skip
    engine = PolicyEngine(
        parse_policy(
            f'[[data]]\npaths = ["/workspace/{NFC_NAME}/**"]\ntier = "restricted"\n'
            '[data_access.restricted]\nread = ["admin"]\n[roles.admin]\n[roles.dev]\n'
        ),
        role="dev",
    )
    assert not engine.op(ReadFile(path=f"{NFD_NAME}/f.txt")).allowed
    assert f"{NFD_NAME}/f.txt" not in sent(root, engine.sandbox_rules().hide)


@pytest.mark.parametrize("glob", ["secret*", "secre?s", "[s]ecrets", "*"])
def test_a_wildcard_that_matches_a_folder_denies_and_classifies_what_is_in_it(
    tmp_path: Path, glob: str
) -> None:
    """The seed leaves the matched folder out whole: the host's own checks read its files as
    inside the glob too, and a write_file cannot put a file back in it, nor a read_file of
    a role without the class's access reach one."""
    root = workspace(tmp_path)
    engine = policy(glob)
    assert not {n for n in sent(root, engine.sandbox_rules().hide) if n.startswith("secrets")}
    for op in (ReadFile(path="secrets/key"), WriteFile(path="secrets/a/b", data=b"x")):
        assert not engine.op(op).allowed, op
    classes = PolicyEngine(
        parse_policy(
            f'[[data]]\npaths = [{_toml(glob)}]\ntier = "restricted"\n'
            '[data_access.restricted]\nread = ["admin"]\nwrite = ["admin"]\n[roles.admin]\n[roles.dev]\n'
        ),
        role="dev",
    )
    for op in (ReadFile(path="secrets/key"), WriteFile(path="secrets/new", data=b"x")):
        assert not classes.op(op).allowed, op
    if glob != "*":
        assert (
            engine.op(ReadFile(path="src/app.py")).allowed and classes.op(ReadFile(path="src/app.py")).allowed
        )


REFUSED = {
    "../secrets/**": "climbs",
    "secrets/../../x": "climbs",
    "src/../secrets": "climbs",
    "/etc/**": "outside the workspace",
    "/workspacex/**": "outside the workspace",
    "/": "outside the workspace",
    "": "names no file",
    "./": "names no file",
    "/workspace/": "names no file",
    "secrets/[ab": "never closes",
}


@pytest.mark.parametrize("glob", list(REFUSED))
def test_a_glob_that_cannot_name_the_workspaces_files_is_refused_where_it_is_taken(glob: str) -> None:
    for field in ("read", "write", "deny"):
        with pytest.raises(exc.PolicyFileError, match=rf"paths\.{field}\.0: .*{REFUSED[glob]}"):
            parse_policy(f"[paths]\n{field} = [{_toml(glob)}]\n")
    with pytest.raises(exc.PolicyFileError, match=rf"data\.0\.paths\.0: .*{REFUSED[glob]}"):
        parse_policy(f'[[data]]\npaths = [{_toml(glob)}]\ntier = "restricted"\n')
    rules: dict[str, Callable[[str], SandboxRules]] = {
        "hide": lambda g: SandboxRules(hide=(g,)),
        "read": lambda g: SandboxRules(read=(g,)),
        "write": lambda g: SandboxRules(write=(g,)),
    }
    for field, made in rules.items():
        with pytest.raises(exc.InvalidArgument, match=f"SandboxRules.{field}: .*{REFUSED[glob]}") as err:
            made(glob)
        assert err.value.argument == f"SandboxRules.{field}" and err.value.fix
        assert not err.value.retryable
    for field in ("hide", "read"):
        with pytest.raises(exc.InvalidArgument, match=REFUSED[glob]):
            upload_op(Path("/"), "/workspace", **{"hide": (), "read": ("**",), field: (glob,)})


def test_a_class_is_one_character_of_it_never_a_slash() -> None:
    assert glob_matches(["[!.]env"], "xenv") and not glob_matches(["[!.]env"], ".env")
    assert glob_matches(["f[0-9].txt"], "f7.txt") and not glob_matches(["f[0-9].txt"], "fa.txt")
    assert not glob_matches(["a[!x]b"], "a/b") and not glob_matches(["a[+-0]b"], "a/b")
    assert glob_matches(["a[]]b"], "a]b") and glob_matches(["a[[]b"], "a[b")
    assert not glob_matches(["[s]ecrets"], "secrets/key")  # a pattern, like *: not its folder's files
    assert glob_matches(["[s]ecrets/**"], "secrets/a/b")


NAME_CHARS = list("ab-!]^[\\*?z.")


@given(st.text(st.sampled_from(NAME_CHARS), min_size=1, max_size=8), st.data())
@settings(max_examples=600, deadline=None)
def test_within_a_name_a_glob_means_what_fnmatch_says(glob: str, data: st.DataObject) -> None:
    # a name made of the glob's own characters, the brackets of a class dropped half the time:
    # random names alone seldom match a class
    chars = [c for c in glob if c not in "*?"]
    shown = "".join(c for c in chars if c not in "[]!") if data.draw(st.booleans()) else "".join(chars)
    name = data.draw(
        st.sampled_from([shown, shown[:1], shown[1:2], "".join(data.draw(st.permutations(chars)))])
    )
    assert glob_matches([glob], name) is fnmatch.fnmatchcase(name, glob), (glob, name)


def test_stockades_own_records_are_hidden_by_their_names_not_as_patterns(tmp_path: Path) -> None:
    """A record's path is hidden literally: a ``[`` in it opens no class (nor an error)."""
    from stockade._globs import literal_glob

    (tmp_path / "runs [1]").mkdir()
    globs = within(tmp_path, [tmp_path / "runs [1]" / "db*?"])
    assert globs == (literal_glob("runs [1]/db*?"),)
    assert glob_matches(globs, "runs [1]/db*?") and not glob_matches(globs, "runs 1/dbxy")
    assert SandboxRules(hide=globs).hide == globs
