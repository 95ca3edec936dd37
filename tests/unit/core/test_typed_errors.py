"""Every mistake in a call to the SDK is a ``StockadeError``: a wrong value is refused where it
is passed with ``InvalidArgument`` naming it, never a bare ``TypeError`` from deep inside,
a ``ProtocolError`` blaming the sandbox, or a value quietly turned into another."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stockade import InvalidArgument, NetworkPolicy, Sandbox
from stockade.agent import Agent, RunLimits
from stockade.egress import Credential, EnvSecret
from stockade.exceptions import StockadeError
from stockade.models import ScriptedModel
from stockade.testing import FakeBackend, MemoryWorkspace
from stockade.tools.base import Toolset

Call = Callable[[Sandbox], object]


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    with Sandbox.create(backend=FakeBackend(MemoryWorkspace())) as sandbox:
        sandbox.files.write("f", "hello")
        yield sandbox


# (what is called, the argument the refusal names)
SANDBOX_CASES: list[tuple[str, Call, str]] = [
    ("run(None)", lambda s: s.commands.run(None), "cmd"),  # type: ignore[arg-type]
    ("run(5)", lambda s: s.commands.run(5), "cmd"),  # type: ignore[arg-type]
    ("run([])", lambda s: s.commands.run([]), "cmd"),
    ("run([b'echo'])", lambda s: s.commands.run([b"echo"]), "cmd"),  # type: ignore[list-item]
    ("run(['echo', 1]) is not str()-ed", lambda s: s.commands.run(["echo", 1]), "cmd"),  # type: ignore[list-item]
    ("run({'a': 1}) is not its keys", lambda s: s.commands.run({"a": 1}), "cmd"),  # type: ignore[arg-type]
    ("run('\\udc80')", lambda s: s.commands.run("\udc80"), "cmd"),
    ("run(cwd=Path)", lambda s: s.commands.run("true", cwd=Path("/tmp")), "cwd"),  # type: ignore[arg-type]
    ("run(cwd=5) is no ProtocolError", lambda s: s.commands.run("pwd", cwd=5), "cwd"),  # type: ignore[arg-type]
    ("run(stdin=5)", lambda s: s.commands.run("cat", stdin=5), "stdin"),  # type: ignore[arg-type]
    ("run(stdin=[...])", lambda s: s.commands.run("cat", stdin=["a"]), "stdin"),  # type: ignore[arg-type]
    ("run(stdin='\\udc80')", lambda s: s.commands.run("cat", stdin="\udc80"), "stdin"),
    ("run(envs={'A': '\\udc80'})", lambda s: s.commands.run("true", envs={"A": "\udc80"}), "envs['A']"),
    ("run(on_stdout=5)", lambda s: s.commands.run("true", on_stdout=5), "on_stdout"),  # type: ignore[arg-type]
    ("write(data='\\udc80')", lambda s: s.files.write("f", "\udc80"), "data"),
    ("write(data=None)", lambda s: s.files.write("f", None), "data"),  # type: ignore[arg-type]
    ("write(data=5)", lambda s: s.files.write("f", 5), "data"),  # type: ignore[arg-type]
    ("write(data=True)", lambda s: s.files.write("f", True), "data"),  # type: ignore[arg-type]
    ("write(mode=None)", lambda s: s.files.write("f", "x", mode=None), "mode"),  # type: ignore[arg-type]
    ("write(mode=-1) is not 0o777", lambda s: s.files.write("f", "x", mode=-1), "mode"),
    ("write(mode='644') is not 0o204", lambda s: s.files.write("f", "x", mode="644"), "mode"),  # type: ignore[arg-type]
    ("write(mode=1.5) is not 1", lambda s: s.files.write("f", "x", mode=1.5), "mode"),  # type: ignore[arg-type]
    (
        "write(mode=0o4755) keeps no setuid bit quietly",
        lambda s: s.files.write("f", "x", mode=0o4755),
        "mode",
    ),
    ("write(path='\\udc80')", lambda s: s.files.write("\udc80", "x"), "path"),
    ("read(path=5)", lambda s: s.files.read(5), "path"),  # type: ignore[call-overload]
    ("read(format='zzz') is no text", lambda s: s.files.read("f", format="zzz"), "format"),  # type: ignore[call-overload]
    ("list(depth=nan)", lambda s: s.files.list("", depth=math.nan), "depth"),  # type: ignore[arg-type]
    ("list(depth=None)", lambda s: s.files.list("", depth=None), "depth"),  # type: ignore[arg-type]
    ("list(depth='1')", lambda s: s.files.list("", depth="1"), "depth"),  # type: ignore[arg-type]
    ("list(depth=1.5)", lambda s: s.files.list("", depth=1.5), "depth"),  # type: ignore[arg-type]
    ("list(depth=-1)", lambda s: s.files.list("", depth=-1), "depth"),
    ("read_range(offset=None)", lambda s: s.files.read_range("f", None, 1), "offset"),  # type: ignore[arg-type]
    ("read_range(offset=nan) is no b''", lambda s: s.files.read_range("f", math.nan, 1), "offset"),  # type: ignore[arg-type]
    ("read_range(length=-1)", lambda s: s.files.read_range("f", 0, -1), "length"),
    ("upload_dir(5)", lambda s: s.files.upload_dir(5), "source"),  # type: ignore[arg-type]
    ("upload_dir(b'.')", lambda s: s.files.upload_dir(b"."), "source"),  # type: ignore[arg-type]
    ("upload_dir(hide='x') is no list of letters", lambda s: s.files.upload_dir(".", hide="x"), "hide"),
    ("download_dir('a\\x00')", lambda s: s.files.download_dir("/nonexistent/a\x00"), "dest"),
    ("download_dir(5)", lambda s: s.files.download_dir(5), "dest"),  # type: ignore[arg-type]
    (
        "download_dir(max_bytes=nan)",
        lambda s: s.files.download_dir("/nonexistent", max_bytes=math.nan),  # type: ignore[arg-type]
        "max_bytes",
    ),
    ("run_code('\\udc80', 'bash')", lambda s: s.run_code("echo \udc80", "bash"), "code"),
    ("run_code('\\udc80')", lambda s: s.run_code("print('\udc80')"), "code"),
]


@pytest.mark.parametrize(
    ("call", "argument"), [c[1:] for c in SANDBOX_CASES], ids=[c[0] for c in SANDBOX_CASES]
)
def test_a_wrong_value_in_a_sandbox_call_is_refused_naming_it(
    sbx: Sandbox, call: Call, argument: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        call(sbx)
    assert caught.value.argument == argument
    assert caught.value.fix and not caught.value.retryable
    assert sbx.files.read("f") == "hello"  # nothing was written on the way


def _create(**kwargs: Any) -> Callable[[], object]:
    return lambda: Sandbox.create(backend=FakeBackend(MemoryWorkspace()), **kwargs).close()


def _credential(**changes: Any) -> Credential:
    settings: dict[str, Any] = {"name": "k", "hosts": ("a.test",), "source": EnvSecret("K")}
    return Credential(**(settings | changes))


CONSTRUCTOR_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("Sandbox.create(tier=[])", lambda: Sandbox.create([]), "tier"),  # type: ignore[arg-type]
    ("Sandbox.create(labels=5)", _create(labels=5), "labels"),
    ("Sandbox.create(labels=['abcd'])", _create(labels=["abcd"]), "labels"),
    ("Sandbox.create(labels={'a': 1})", _create(labels={"a": 1}), "labels['a']"),
    ("Sandbox.create(rules='x')", _create(rules="x"), "rules"),
    ("Sandbox.create(network=1.0)", _create(network=1.0), "network"),
    ("Sandbox.create(network={})", _create(network={}), "network"),
    ("Sandbox.create(workspace=5)", _create(workspace=5), "workspace"),
    ("Sandbox.create(workspace=b'..')", _create(workspace=b".."), "workspace"),
    ("Sandbox.create(allow_weaker='no')", _create(allow_weaker="no"), "allow_weaker"),
    ("Sandbox.create(approver=5)", _create(approver=5), "approver"),
    ("Sandbox.create(prefer='fast')", lambda: Sandbox.create(prefer="fast"), "prefer"),  # type: ignore[arg-type]
    ("NetworkPolicy(allow_hosts=None)", lambda: NetworkPolicy(allow_hosts=None), "NetworkPolicy.allow_hosts"),  # type: ignore[arg-type]
    ("NetworkPolicy(allow_hosts=b'x')", lambda: NetworkPolicy(allow_hosts=b"x"), "NetworkPolicy.allow_hosts"),  # type: ignore[arg-type]
    (
        "NetworkPolicy(allow_hosts='pypi.org')",
        lambda: NetworkPolicy(allow_hosts="pypi.org"),  # type: ignore[arg-type]
        "NetworkPolicy.allow_hosts",
    ),
    ("NetworkPolicy(rules=None)", lambda: NetworkPolicy(rules=None), "NetworkPolicy.rules"),  # type: ignore[arg-type]
    (
        "NetworkPolicy(allow_addresses=5)",
        lambda: NetworkPolicy(allow_addresses=5),  # type: ignore[arg-type]
        "NetworkPolicy.allow_addresses",
    ),
    (
        "NetworkPolicy(allow_addresses=('not-a-net',))",
        lambda: NetworkPolicy(allow_hosts=("a.test",), allow_addresses=("not-a-net",)),
        "NetworkPolicy.allow_addresses",
    ),
    (
        "NetworkPolicy(resolve=pinned to a name)",
        lambda: NetworkPolicy(resolve={"a.test": ("b.test",)}),
        "NetworkPolicy.resolve",
    ),
    (
        "NetworkPolicy(resolve=pinned to none)",
        lambda: NetworkPolicy(resolve={"a.test": ()}),
        "NetworkPolicy.resolve",
    ),
    ("NetworkPolicy(resolve=[])", lambda: NetworkPolicy(resolve=[]), "NetworkPolicy.resolve"),  # type: ignore[arg-type]
    (
        "NetworkPolicy(upstream_ca=missing)",
        lambda: NetworkPolicy(upstream_ca="/nonexistent/ca.pem"),
        "NetworkPolicy.upstream_ca",
    ),
    ("NetworkPolicy(credentials=[5])", lambda: NetworkPolicy(credentials=(5,)), "NetworkPolicy.credentials"),  # type: ignore[arg-type]
    ("Credential(style='weird')", lambda: _credential(style="weird"), "Credential.style"),
    ("Credential(header=CRLF)", lambda: _credential(header="X-K\r\nX-Injected: 1"), "Credential.header"),
    ("Credential(header='')", lambda: _credential(header=""), "Credential.header"),
    ("Credential(hosts='a.test')", lambda: _credential(hosts="a.test"), "Credential.hosts"),
    ("Credential(username=colon)", lambda: _credential(style="basic", username="a:b"), "Credential.username"),
    ("Credential(source=5)", lambda: _credential(source=5), "Credential.source"),
    ("RunLimits(max_steps=None)", lambda: RunLimits(max_steps=None), "RunLimits.max_steps"),  # type: ignore[arg-type]
    ("RunLimits(max_wall_s='5')", lambda: RunLimits(max_wall_s="5"), "RunLimits.max_wall_s"),  # type: ignore[arg-type]
    ("RunLimits(max_tokens=nan)", lambda: RunLimits(max_tokens=math.nan), "RunLimits.max_tokens"),  # type: ignore[arg-type]
    ("Agent(None)", lambda: Agent(None), "model"),  # type: ignore[arg-type]
    ("Agent(b'')", lambda: Agent(b""), "model"),  # type: ignore[arg-type]
    ("Agent(tools=[])", lambda: Agent(ScriptedModel([]), tools=[]), "tools"),  # type: ignore[arg-type]
    ("Agent(guards=5)", lambda: Agent(ScriptedModel([]), guards=5), "guards"),  # type: ignore[arg-type]
    ("Agent(limits={})", lambda: Agent(ScriptedModel([]), limits={}), "limits"),  # type: ignore[arg-type]
    ("Toolset(None)", lambda: Toolset(None), "tools"),  # type: ignore[arg-type]
    ("Toolset(['x'])", lambda: Toolset(["x"]), "tools"),  # type: ignore[list-item]
    ("Toolset(wrappers=[5])", lambda: Toolset([], wrappers=[5]), "wrappers"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("make", "argument"), [c[1:] for c in CONSTRUCTOR_CASES], ids=[c[0] for c in CONSTRUCTOR_CASES]
)
def test_a_wrong_setting_is_refused_naming_it(make: Callable[[], object], argument: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        make()
    assert caught.value.argument == argument
    assert caught.value.fix and not caught.value.retryable


def test_the_right_values_still_pass(sbx: Sandbox, tmp_path: Path) -> None:
    assert sbx.commands.run(["echo", "hi"], cwd="/workspace", stdin=b"x").exit_code == 0
    assert sbx.files.write("g", b"\xff", mode=0o600).size == 1
    assert sbx.files.read_range("g", 0, 1) == b"\xff"
    assert sbx.files.list("", depth=2)
    assert NetworkPolicy(allow_hosts=["pypi.org"], enabled=True).egress  # type: ignore[arg-type]  # a list is fine
    # a lone address pins a name to that one address (not to its characters, one by one)
    assert NetworkPolicy(resolve={"a.test": "10.1.2.3"}).resolve == {"a.test": ("10.1.2.3",)}  # type: ignore[dict-item]
    assert RunLimits(max_wall_s=5, max_cost_usd=0.5).max_steps == 30
    _create(labels={"team": "a=b"}, workspace=tmp_path)()


# -- the property: whatever is passed, what comes out is a StockadeError ------------------

_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\x00", "\udc80", "..", "/", "/workspace/..", "a" * 300, "f", "*"]),
)
_weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(),
    _text,
    st.binary(max_size=8),
    st.lists(_text, max_size=3),
    st.builds(Path, st.text(max_size=5)),
    st.dictionaries(_text, _text, max_size=2),
)
# The calls and their keyword arguments; the host-folder ones are in the table above, since a
# random host path would upload or write real folders.
CALLS: dict[str, tuple[Callable[[Sandbox, Any, dict[str, Any]], object], tuple[str, ...]]] = {
    "run": (lambda s, a, k: s.commands.run(a, **k), ("cwd", "envs", "timeout_s", "stdin", "on_stdout")),
    "read": (lambda s, a, k: s.files.read(a, **k), ("format",)),
    "write": (lambda s, a, k: s.files.write(a, k.pop("data", "x"), **k), ("data", "mode")),
    "list": (lambda s, a, k: s.files.list(a, **k), ("depth",)),
    "stat": (lambda s, a, k: s.files.stat(a), ()),
    "remove": (lambda s, a, k: s.files.remove(a), ()),
    "make_dir": (lambda s, a, k: s.files.make_dir(a), ()),
    "read_range": (
        lambda s, a, k: s.files.read_range(a, k.get("offset", 0), k.get("length", 1)),
        ("offset", "length"),
    ),
    "run_code": (lambda s, a, k: s.run_code(a, **k), ("language", "timeout_s")),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_value_given_to_a_sandbox_call_fails_typed_or_not_at_all(
    sbx: Sandbox, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(CALLS)), label="call")
    call, keywords = CALLS[name]
    first = data.draw(_weird, label="first argument")
    kwargs = data.draw(st.fixed_dictionaries({}, optional=dict.fromkeys(keywords, _weird)), label="keywords")
    try:
        call(sbx, first, dict(kwargs))
    except StockadeError as err:
        assert not err.retryable, f"{name}({first!r}, {kwargs!r}): a caller's mistake is not worth a retry"
