"""The in-sandbox modules run on whatever Python the sandbox has: stdlib only, Python >= 3.8."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.sandbox.supervisor import sources

MODULES = sorted(name for name in sources() if name.endswith(".py"))


@pytest.mark.parametrize("name", MODULES)
def test_a_supervisor_module_parses_as_python_3_8_and_imports_only_the_stdlib(name: str) -> None:
    tree = ast.parse(sources()[name], filename=name, feature_version=(3, 8))
    siblings = {n.removesuffix(".py") for n in MODULES}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    foreign = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m not in siblings}
    assert not foreign, f"{name} imports {sorted(foreign)}: the sandbox has only the standard library"


def test_the_interpreter_module_imports_nothing_heavy(tmp_path: Path) -> None:
    # It is imported on every sandbox's first run_code: what it imports is that call's wait.
    for name, data in sources().items():
        if not name.endswith(".py"):
            continue
        (tmp_path / name).write_bytes(data)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); import interpreter; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-s", "-B", "-c", probe, str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    loaded = set(done.stdout.split())
    assert "interpreter" in loaded
    heavy = {"ast", "inspect", "typing", "traceback", "base64", "re", "json", "asyncio", "site", "enum"}
    assert not loaded & heavy


def test_a_sandbox_start_imports_no_reset_code() -> None:
    # Only a reset (a pool's, between users) needs reset.py: the supervisor imports it then,
    # so that the start every sandbox pays for loads none of it.
    tree = ast.parse(sources()["supervisor.py"], filename="supervisor.py")
    at_start = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    at_start |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert "commands" in at_start
    assert "reset" not in at_start
    assert "reset.py" in sources()  # shipped all the same
