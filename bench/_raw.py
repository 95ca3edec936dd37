"""The raw mechanisms the tiers are measured against: bubblewrap with every namespace
unshared, running the same ``print(1)``; ``runsc run`` on a bundle. Imports nothing of
stockade, so that ``cold_versions.py``'s workers can take it before importing their own
version."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

RAW_BWRAP = [
    "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--uid", "1000", "--gid", "1000", "--clearenv",
]  # fmt: skip
PRINT1 = ["/usr/bin/python3", "-c", "print(1)"]


def runsc_run(
    workdir: Path, config: dict[str, object], argv: list[str], platform: str
) -> Callable[[], bytes]:
    """``runsc run`` of ``argv`` on a bundle with ``config`` (an OCI config.json), to its exit."""
    folder = Path(tempfile.mkdtemp(dir=workdir))
    (folder / "bundle").mkdir()
    config = json.loads(json.dumps(config))
    process = config["process"]
    assert isinstance(process, dict)
    process["args"], process["cwd"] = argv, "/"
    linux = config.get("linux")
    if isinstance(linux, dict):
        linux.pop("cgroupsPath", None)
    (folder / "bundle" / "config.json").write_text(json.dumps(config))
    count = iter(range(1_000_000))  # a fresh container name each run

    def run() -> bytes:
        argv_ = ["runsc", "--root", str(folder / "root"), f"--platform={platform}", "--network=none"]
        argv_ += ["run", "--bundle", str(folder / "bundle"), f"bench-{os.getpid()}-{next(count)}"]
        return subprocess.run(argv_, check=True, capture_output=True).stdout

    return run
