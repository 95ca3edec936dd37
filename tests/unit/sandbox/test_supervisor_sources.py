"""The in-sandbox modules run on whatever Python the sandbox has: stdlib only, Python >= 3.8."""

from __future__ import annotations

import ast
import sys

import pytest

from stockade.sandbox.supervisor import sources

MODULES = sorted(sources())


@pytest.mark.parametrize("name", MODULES)
def test_a_supervisor_module_parses_as_python_3_8_and_imports_only_the_stdlib(name: str) -> None:
    tree = ast.parse(sources()[name], filename=name, feature_version=(3, 8))
    siblings = {n.removesuffix(".py") for n in MODULES}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    foreign = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m not in siblings}
    assert not foreign, f"{name} imports {sorted(foreign)}: the sandbox has only the standard library"
