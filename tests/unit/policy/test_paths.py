from __future__ import annotations

import contextlib
import posixpath

from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import exceptions as exc
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import GuardContext, GuardedBackend, op_policy_guard
from stockade.policy.paths import normalise, readable, writable
from stockade.policy.schema import PathRules, Policy
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import WriteFile
from stockade.testing import FakeBackend, MemoryWorkspace

RULES = PathRules(read=("**",), write=("src/**", "tests/*.py"), deny=("src/secret", ".git/**"))


def test_globs_over_normalised_workspace_paths() -> None:
    assert writable(RULES, "src/app.py")
    assert writable(RULES, "/workspace/src/pkg/mod.py")
    assert writable(RULES, "tests/test_app.py")
    assert not writable(RULES, "tests/unit/test_app.py")  # * stays within a directory
    assert not writable(RULES, "README.md")
    assert not writable(RULES, "src/secret/key.pem")  # a denied directory covers what is below
    assert not writable(RULES, "src/../.git/config")
    assert not readable(RULES, "../outside")
    assert not readable(RULES, "/etc/passwd")
    assert readable(RULES, "README.md")


def oracle_writable(path: str) -> bool:
    """The same rules, written differently: by splitting the normalised path into parts."""
    if path.startswith("/") and not path.startswith("/workspace/"):
        return False
    rel = path.removeprefix("/workspace/") if path.startswith("/workspace/") else path
    stack: list[str] = []
    for part in rel.split("/"):
        if part == "..":
            if not stack:
                return False
            stack.pop()
        elif part not in ("", "."):
            stack.append(part)
    if stack[:1] == [".git"] or stack[:2] == ["src", "secret"]:
        return False
    return (stack[:1] == ["src"] and len(stack) >= 2) or (
        len(stack) == 2 and stack[0] == "tests" and stack[1].endswith(".py")
    )


SEGMENTS = st.sampled_from(["src", "tests", "secret", ".git", "..", ".", "", "a.py", "x", "config"])
PATHS = st.builds(
    lambda prefix, parts: prefix + "/".join(parts),
    st.sampled_from(["", "/workspace/", "/", "./"]),
    st.lists(SEGMENTS, min_size=1, max_size=6),
)


@given(PATHS)
@settings(max_examples=500, deadline=None)
def test_path_rules_agree_with_an_independent_oracle(path: str) -> None:
    assert writable(RULES, path) == oracle_writable(path)


@given(st.lists(PATHS, min_size=1, max_size=10))
@settings(max_examples=200, deadline=None)
def test_no_denied_path_is_ever_written(paths: list[str]) -> None:
    backend = FakeBackend(MemoryWorkspace())
    guard = op_policy_guard(PolicyEngine(Policy(paths=RULES)))
    instance = GuardedBackend(backend, guard, GuardContext()).start(SandboxSpec())
    for path in paths:
        with contextlib.suppress(exc.PolicyDenied, exc.WorkspaceError):
            instance.execute(WriteFile(path=path, data=b"x"))
    for op in backend.instances[0].ops:
        assert isinstance(op, WriteFile) and oracle_writable(op.path)
        norm = normalise(op.path)
        assert norm is not None and not posixpath.isabs(norm)
