"""What stockade runs, loads or mounts from its cache and state folder is used only where no
other user could have put it: a cache or state folder another uid owns, that a group or
others may write, or reached through a swapped symlink is refused (``UntrustedPath``), and
nothing in it runs."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade.exceptions import ConfigurationError, UntrustedPath
from stockade.sandbox import _guest, _judge, _launch, _native, _shim, _trusted
from stockade.sandbox._microvm_jail import RAM_SHIM_FLAGS, RAM_SHIM_SOURCE, ram_shim
from tests.conftest import require

OTHER_UID = 65534  # nobody: another user of the host

# Each built program or library, as its caller finds it in a cache folder.
BUILDS: dict[str, tuple[Path, tuple[str, ...], Callable[[Path], object]]] = {
    "launcher": (_launch.SOURCE, _launch.FLAGS, _launch.usable),
    "judge": (_judge.SOURCE, _judge.FLAGS, _judge.built),
    "shim": (_shim.SOURCE, _shim.FLAGS, _shim.build),
    "QEMU's RAM shim": (RAM_SHIM_SOURCE, RAM_SHIM_FLAGS, ram_shim),
}


def as_root() -> None:
    require("root (to give a file to another uid)", os.geteuid() == 0, "only root chowns")


def plant(folder: Path, source: Path, flags: tuple[str, ...], marker: Path) -> Path:
    """What another user leaves in a cache: a "build" that leaves ``marker`` if it runs."""
    require("x86_64 (the only place builds are used)", platform.machine() == "x86_64")
    target = _native._target(source, flags, folder)
    target.parent.mkdir(parents=True)
    target.write_text(f"#!/bin/sh\nid > {marker}\nexit 0\n")
    target.chmod(0o755)
    return target


@pytest.mark.parametrize("name", BUILDS)
def test_a_build_in_a_cache_another_user_owns_is_refused_and_never_run(name: str, tmp_path: Path) -> None:
    as_root()
    source, flags, find = BUILDS[name]
    cache, marker = tmp_path / "sharedcache", tmp_path / "pwned"
    planted = plant(cache / "c", source, flags, marker)
    for path in (cache, planted.parent, planted):
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedPath, match=f"owned by uid {OTHER_UID}") as caught:
        find(cache / "c")
    assert caught.value.path == str(cache) and not marker.exists()


@pytest.mark.parametrize("name", BUILDS)
def test_a_build_under_a_folder_others_may_write_is_refused(name: str, tmp_path: Path) -> None:
    source, flags, find = BUILDS[name]
    marker = tmp_path / "pwned"
    planted = plant(tmp_path / "cache" / "c", source, flags, marker)
    os.chmod(tmp_path / "cache", 0o777)  # no sticky bit: anyone may rename what is in it
    with pytest.raises(UntrustedPath, match="writable by its group or by others") as caught:
        find(tmp_path / "cache" / "c")
    assert caught.value.path == str(tmp_path / "cache") and not marker.exists()
    os.chmod(tmp_path / "cache", 0o755)
    os.chmod(planted, 0o777)
    with pytest.raises(UntrustedPath, match="mode 777"):
        find(tmp_path / "cache" / "c")
    assert not marker.exists()


def test_the_launcher_from_a_shared_cache_setting_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The outside tester's case: root, with STOCKADE_CACHE at another user's folder.
    as_root()
    cache, marker = tmp_path / "sharedcache", tmp_path / "pwned"
    planted = plant(cache / "launch", _launch.SOURCE, _launch.FLAGS, marker)
    for path in (cache, planted.parent, planted):
        os.chown(path, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("STOCKADE_CACHE", str(cache))
    with pytest.raises(ConfigurationError, match="another user could put their own code there"):
        _launch.usable()
    assert not marker.exists()


def test_a_symlink_to_another_users_build_is_followed_and_refused(tmp_path: Path) -> None:
    as_root()
    marker = tmp_path / "pwned"
    theirs = plant(tmp_path / "theirs", _launch.SOURCE, _launch.FLAGS, marker)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    ours = _native._target(_launch.SOURCE, _launch.FLAGS, tmp_path / "ours")
    ours.parent.mkdir()
    ours.symlink_to(theirs)
    with pytest.raises(UntrustedPath, match=f"owned by uid {OTHER_UID}") as caught:
        _launch.usable(tmp_path / "ours")
    assert caught.value.path == str(theirs) and not marker.exists()


def test_a_state_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    # /tmp/stockade-<uid>, made by someone else before us: their boot.py would run first in
    # every container.
    as_root()
    state = tmp_path / "stockade-1002"
    state.mkdir(mode=0o777)
    os.chown(state, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedPath, match=f"owned by uid {OTHER_UID}"):
        _guest.supervisor_dir(state, "sha256:image")
    assert list(state.iterdir()) == []


def test_a_state_folder_swapped_after_first_use_is_refused(tmp_path: Path) -> None:
    # The folder is remembered per process: a swap after the first call must not be trusted.
    as_root()
    state = tmp_path / "state"
    first = _guest.supervisor_dir(state, "sha256:swapped")
    assert first.is_dir() and first.parent == state
    shutil.rmtree(state)
    (state / first.name).mkdir(parents=True)
    (state / first.name / "boot.py").write_text("raise SystemExit('theirs')\n")
    for path in (state, state / first.name):
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedPath, match=f"owned by uid {OTHER_UID}"):
        _guest.supervisor_dir(state, "sha256:swapped")


def test_ours_and_roots_and_sticky_folders_pass_and_new_folders_ignore_the_umask(tmp_path: Path) -> None:
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /tmp: only an entry's owner may rename it
    old = os.umask(0o002)
    try:
        made = _trusted.folder(sticky / "a" / "b", 0o711)
    finally:
        os.umask(old)
    assert made == sticky / "a" / "b"
    assert [oct(os.stat(p).st_mode & 0o7777) for p in (sticky / "a", made)] == ["0o711", "0o711"]
    assert _trusted.check(made / "not-yet" / "there") == made / "not-yet" / "there"


def test_the_error_is_typed_and_pickles() -> None:
    import pickle

    err = UntrustedPath("stockade will not use /x", path="/x", fix="chmod go-w /x")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, UntrustedPath) and isinstance(back, ConfigurationError)
    assert back.retryable is False
    assert (back.path, back.fix) == ("/x", "chmod go-w /x")
    assert str(back) == "stockade will not use /x; chmod go-w /x"
