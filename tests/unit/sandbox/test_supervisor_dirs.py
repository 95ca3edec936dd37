"""The supervisor's folder for container tiers: one per image, never shared across images."""

from __future__ import annotations

from pathlib import Path

from stockade.sandbox import _guest


def test_each_image_gets_its_own_kernel_folder(tmp_path: Path) -> None:
    # Bytecode in the folder is compiled by the image's own python (as trusted as the
    # image): a hostile image must not be able to plant bytecode for another image.
    a = _guest.supervisor_dir(tmp_path, "sha256:image-a")
    b = _guest.supervisor_dir(tmp_path, "sha256:image-b")
    assert a != b and a.is_dir() and b.is_dir()
    assert _guest.supervisor_dir(tmp_path, "sha256:image-a") == a
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
