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


def _imported_at_start(name: str, siblings: set[str]) -> set[str]:
    """The sibling modules ``name`` loads as it is imported, transitively: its module-level
    imports, not those in functions (lazy) nor under ``if TYPE_CHECKING``."""
    tree = ast.parse(sources()[f"{name}.py"], filename=f"{name}.py")
    direct = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    direct |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    found = direct & siblings
    for module in sorted(found):
        found |= _imported_at_start(module, siblings - {name, *found})
    return found


def test_a_sandbox_start_loads_the_supervisors_modules_it_needs_and_no_more() -> None:
    # Each module is a file found, read and loaded at every sandbox's start (the cold start):
    # a new one here is a choice, not a side effect of a split. A reset's code (reset.py) is
    # imported at the first reset; the rules', the relay's and the interpreter's only where used.
    siblings = {n.removesuffix(".py") for n in MODULES}
    assert _imported_at_start("supervisor", siblings - {"supervisor"}) == {
        "baseline",
        "eventloop",
        "fileops",
        "files",
        "jobs",
        "libc",
        "proctree",
        "protocol",
        "reaper",
        "runcode",
        "zygote",
    }
    assert "reset.py" in sources()  # shipped all the same


def test_the_rules_and_the_relay_load_their_own_modules_where_used() -> None:
    # The rules' set-up builds on the compiled judge's layer (fastjudge) and keeps its records
    # as the Python judge does (execrecords): a start under rules loads both, and the Python
    # judge's modules only at the first exec that reaches it (rulespy, execjudge). The relay of
    # a socket bound in loads nothing of ours; the microVM's (egressmux) only where asked.
    siblings = {n.removesuffix(".py") for n in MODULES}
    assert _imported_at_start("rules", siblings - {"rules"}) == {
        "execrecords",
        "fastjudge",
        "libc",
        "proctree",
        "protocol",
        "reaper",
    }
    assert _imported_at_start("egress", siblings - {"egress"}) == set()
    assert _imported_at_start("egressmux", siblings - {"egressmux"}) == {"egress"}


def test_a_start_that_refuses_calls_loads_the_call_filters_alone() -> None:
    # A start on gVisor, or under a tier's kernel filters, installs the calls it refuses
    # (callfilters) and none of the policy's rules (confine, Landlock and the exec listener):
    # it loads one module of ours beside the start's, not the rules' too. The rules' Python
    # set-up goes through both.
    siblings = {n.removesuffix(".py") for n in MODULES}
    assert _imported_at_start("callfilters", siblings - {"callfilters"}) == {"libc"}
    assert _imported_at_start("confine", siblings - {"confine"}) == {"callfilters", "libc"}
    assert _imported_at_start("noexec", siblings - {"noexec"}) == {"libc"}
