from __future__ import annotations

import contextlib
import posixpath
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import exceptions as exc
from stockade.policy.engine import PolicyEngine
from stockade.policy.guards import GuardedBackend, OpContext, op_policy_guard
from stockade.policy.paths import normalise, readable, writable
from stockade.policy.schema import PathRules, Policy
from stockade.sandbox.base import SandboxSpec
from stockade.sandbox.ops import RunCommand, WriteFile
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
    instance = GuardedBackend(backend, guard, OpContext()).start(SandboxSpec())
    for path in paths:
        with contextlib.suppress(exc.PolicyDenied, exc.WorkspaceError):
            instance.execute(WriteFile(path=path, data=b"x"))
    for op in backend.instances[0].ops:
        assert isinstance(op, WriteFile) and oracle_writable(op.path)
        norm = normalise(op.path)
        assert norm is not None and not posixpath.isabs(norm)


# Shell lines that write files by name: the command rules read their targets from the parsed
# argv and redirections, and judge each against the same path rules.
WRITERS = st.sampled_from(
    [
        "echo x > {}", "echo x >> {}", "make &> {}", "ls | tee -a {}", "cp src/a.py {}", "mv src/a.py {}",
        "rm -rf {}", "touch {}", "dd if=src/a.py of={}", "sed -i s/a/b/ {}", "nice -n 5 truncate -s 0 {}",
        "env A=1 ln -s {} src/link", "sh -c 'cat < src/a.py > {}'",
    ]
)  # fmt: skip
TARGETS = st.builds(
    lambda prefix, parts: prefix + "/".join(parts),
    st.sampled_from(["", "/workspace/", "./"]),
    st.lists(
        st.sampled_from(["src", "tests", "secret", ".git", "..", ".", "a.py", "x", "*", "*.py"]),
        min_size=1,
        max_size=4,
    ),
)
JOINERS = st.sampled_from([" ; ", " && ", " | ", " || ", "\n"])
LINES = st.lists(st.tuples(WRITERS, TARGETS), min_size=1, max_size=3)


def _every_expansion_writable(target: str) -> bool:
    """What a wildcard may expand to, sampled: one file name per kind the rules tell apart."""
    if "*" not in target:
        return oracle_writable(target)
    return all(oracle_writable(target.replace("*", name)) for name in ("x", "secret", ".git", "a.py", "t.py"))


def _line(parts: list[tuple[str, str]], joiner: str) -> str:
    return joiner.join(template.format(shlex.quote(target)) for template, target in parts)


@given(LINES, JOINERS)
@settings(max_examples=400, deadline=None)
def test_no_shell_line_the_policy_allows_writes_a_denied_path(
    parts: list[tuple[str, str]], joiner: str
) -> None:
    engine = PolicyEngine(Policy(paths=RULES))
    decision = engine.op(RunCommand(argv=("/bin/sh", "-c", _line(parts, joiner))))
    if decision.allowed:
        assert all(_every_expansion_writable(target) for _, target in parts)


@given(st.lists(st.tuples(LINES, JOINERS), min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_no_command_writing_a_denied_path_ever_reaches_the_sandbox(
    lines: list[tuple[list[tuple[str, str]], str]],
) -> None:
    backend = FakeBackend(MemoryWorkspace())
    guard = op_policy_guard(PolicyEngine(Policy(paths=RULES)))
    instance = GuardedBackend(backend, guard, OpContext()).start(SandboxSpec())
    targets: dict[str, list[str]] = {}
    for parts, joiner in lines:
        line = _line(parts, joiner)
        targets[line] = [target for _, target in parts]
        with contextlib.suppress(exc.PolicyDenied):
            instance.execute(RunCommand(argv=("/bin/sh", "-c", line)))
    for op in backend.instances[0].ops:
        assert isinstance(op, RunCommand)
        assert all(_every_expansion_writable(t) for t in targets[op.argv[2]])


@pytest.mark.parametrize(
    ("line", "allowed"),
    [
        ("echo x > src/a.py", True),
        ("echo x > src/secret/key", False),  # redirections are writes
        ("cat src/a.py >> README.md", False),
        ("python3 -m pytest 2>/dev/null > /tmp/log", True),  # the sandbox's scratch files
        ("echo x > /etc/profile", False),
        ("ls | tee src/a.py .git/config", False),
        ("cp src/a.py .git/hooks/pre-commit", False),
        ("mv src/secret/key src/key", False),  # a move writes (removes) its source
        ("rm -rf src/build/*", True),  # the wildcard stays inside a writable tree
        ("rm -rf src/*", False),  # ... which may name src/secret
        ("dd if=src/a.py of=tests/t.py", True),
        ("dd if=src/a.py of=.git/x", False),
        ("ls | xargs rm", False),  # cannot tell what it removes
        ("echo x > $HOME/f", False),
        ("cd src; echo x > a.py", False),  # judged in both directories it may run in
        ("cat < README.md", True),
    ],
)
def test_command_lines_are_judged_by_the_files_they_write(line: str, allowed: bool) -> None:
    engine = PolicyEngine(Policy(paths=RULES))
    assert engine.op(RunCommand(argv=("/bin/sh", "-c", line))).allowed is allowed


def test_without_path_rules_only_leaving_the_workspace_is_refused() -> None:
    engine = PolicyEngine(Policy())
    assert engine.op(RunCommand(argv=("sh", "-c", "rm -rf * && echo x > $OUT && ls | xargs rm"))).allowed
    assert not engine.op(RunCommand(argv=("sh", "-c", "echo x > ../outside"))).allowed
