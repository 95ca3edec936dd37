"""The policy's [network] and [credentials], as the sandbox of each role gets them."""

from __future__ import annotations

import pytest

from stockade import exceptions as exc
from stockade.egress import EnvSecret, FileSecret
from stockade.policy import PolicyEngine
from stockade.policy.load import parse_policy
from stockade.types import HostRule

POLICY = """
[network]
allow = [
  "pypi.org", "files.pythonhosted.org", "*.github.com",
  { host = "api.internal.test", ports = [8443], methods = ["GET"], roles = ["ci"] },
]
allow_addresses = ["10.1.0.0/16"]
max_requests_per_minute = 100

[credentials.github]
source = "env:GITHUB_TOKEN"
hosts = ["api.github.com"]

[credentials.index]
source = "file:/run/secrets/index"
hosts = ["pypi.org"]
style = "basic"
username = "ci"
roles = ["ci"]

[roles.ci]
credentials = ["github"]

[roles.analyst]
tools = ["read_file"]
"""


def test_each_role_gets_its_hosts_and_credentials() -> None:
    policy = parse_policy(POLICY)
    ci = PolicyEngine(policy, role="ci").network_policy()
    analyst = PolicyEngine(policy, role="analyst").network_policy()
    assert ci.egress and analyst.egress and not ci.unrestricted
    assert HostRule(host="api.internal.test", ports=(8443,), methods=("GET",)) in ci.host_rules
    assert [r.host for r in analyst.host_rules] == ["pypi.org", "files.pythonhosted.org", "*.github.com"]
    assert [(c.name, c.source) for c in ci.credentials] == [
        ("github", EnvSecret("GITHUB_TOKEN")),
        ("index", FileSecret("/run/secrets/index")),
    ]
    assert analyst.credentials == ()
    assert ci.allow_addresses == ("10.1.0.0/16",) and ci.max_requests_per_minute == 100


def test_the_network_stays_off_by_default() -> None:
    network = PolicyEngine(parse_policy("")).network_policy()
    assert not network.egress and not network.enabled


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[roles.r]\ncredentials = ["nope"]\n', "roles.r.credentials names 'nope'"),
        ('[credentials.c]\nsource = "GITHUB_TOKEN"\nhosts = ["a.b"]\n', "credentials.c.source"),
        ('[credentials.c]\nsource = "env:X"\nhosts = []\n', "credentials.c.hosts"),
        ('[network]\nallow_addresses = ["10.0.0.0/33"]\n', "network.allow_addresses"),
        ('[network]\nallow = [{ host = "a.b", roles = ["x"] }]\n', "names role 'x'"),
        # what the proxy would have sent or looked up per request, refused when the file is read
        ('[network]\nresolve = { "db.test" = ["db.other"] }\n', "network: NetworkPolicy.resolve"),
        (
            '[credentials.c]\nsource = "env:X"\nhosts = ["a.b"]\nheader = "X-K\\r\\nX-Injected: 1"\n',
            "credentials.c: ",
        ),
        ('[credentials.c]\nsource = "env:X"\nhosts = ["a.b"]\nheader = "X K"\n', "is no HTTP header name"),
        ('[credentials.c]\nsource = "env:X"\nhosts = ["a.b"]\nstyle = "basic"\nusername = "a:b"\n', "colon"),
    ],
)
def test_mistakes_are_reported(text: str, problem: str) -> None:
    with pytest.raises(exc.PolicyFileError) as bad:
        parse_policy(text)
    assert any(problem in p for p in bad.value.problems), bad.value.problems


def test_the_readmes_network_section_is_what_the_code_does() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[3] / "README.md").read_text()
    section = text.split("## The network: an allowlist", 1)[1].split("\n## ", 1)[0]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    policy = parse_policy("version = 1\n" + toml + '\n[roles.dev]\ntools = ["read_file"]\n')
    ci = PolicyEngine(policy, role="ci").network_policy()
    assert [(r.host, r.ports, r.methods) for r in ci.host_rules] == [
        ("pypi.org", (80, 443), ()),
        ("files.pythonhosted.org", (80, 443), ()),
        ("api.github.com", (443,), ("GET",)),
    ]
    assert [(c.name, c.hosts, c.style) for c in ci.credentials] == [("github", ("api.github.com",), "bearer")]
    dev = PolicyEngine(policy, role="dev").network_policy()
    assert [r.host for r in dev.host_rules] == ["pypi.org", "files.pythonhosted.org"]
    assert dev.credentials == ()
    namespace: dict[str, object] = {}
    exec(code.split("with ", 1)[0], namespace)  # the sandbox itself needs the internet: not here
    assert namespace["allow"].egress  # type: ignore[attr-defined]
    compile(code, "README.md", "exec")
