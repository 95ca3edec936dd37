"""Controlled egress on every tier: the allowlist proxy is the only way out of a sandbox.

Local HTTP and HTTPS servers answer on 127.0.0.2 and 127.0.0.3 under made-up names that the
proxy's resolver maps (tests/egress_servers.py). From inside: urllib, requests, pip (both
copied into the workspace from this environment, where the image has none) and curl
(in every image: scripts/build-image.sh) reach what is allowed; every other route is refused, each with the
reason the code can read; the credential reaches the server and is nowhere in the sandbox.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stockade import (
    LimitNotEnforceable,
    Limits,
    Sandbox,
    SandboxPool,
    SandboxStartError,
    SnapshotKind,
    SnapshotStore,
)
from stockade.audit.events import EventKind
from stockade.audit.sandbox import AuditedBackend
from stockade.egress import _attach
from stockade.sandbox import _registry
from stockade.sandbox.ops import PutArchive
from stockade.testing import capture_audit
from stockade.types import Credential, NetworkPolicy
from tests.conftest import host_processes, require, require_tier, wait_for
from tests.egress_servers import HEADER_NAME_ECHOES, MIXED_TOKEN, REFUSED_ECHOES, TOKEN, Servers, servers
from tests.integration.conftest import TIERS
from tests.integration.microvm_images import BootImages

LIMITS = Limits(memory_mb=512, timeout_s=120, pids=64)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with servers(tmp_path_factory.mktemp("egress")) as found:
        yield found


def _libraries() -> bytes:
    """requests (and what it needs) and pip from this environment, as a tar for lib/."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("requests", "urllib3", "idna", "certifi", "charset_normalizer", "pip"):
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.origin is not None, name
            folder = Path(spec.origin).parent
            tar.add(folder, arcname=f"lib/{name}", filter=lambda i: None if "__pycache__" in i.name else i)
    return buf.getvalue()


@pytest.fixture(scope="module")
def libraries() -> bytes:
    return _libraries()


@pytest.fixture(params=TIERS)
def egress_tier(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    require_tier(name)
    return name


def _sandbox(tier: str, network: NetworkPolicy) -> Sandbox:
    return Sandbox.create(tier, limits=LIMITS, network=network)


CLIENTS = """
import json, os, ssl, sys, urllib.request, urllib.error
sys.path.insert(0, "/workspace/lib")
http_port, https_port = int(sys.argv[1]), int(sys.argv[2])
out = {}
out["urllib_http"] = urllib.request.urlopen(f"http://pkg.test:{http_port}/a", timeout=20).read().decode()
auth = f"https://api.test:{https_port}/auth"
out["urllib_https"] = urllib.request.urlopen(auth, timeout=20).read().decode()
import requests
out["requests_http"] = requests.get(f"http://pkg.test:{http_port}/b", timeout=20).text
out["requests_https"] = requests.get(f"https://api.test:{https_port}/auth", timeout=20).text
out["echo"] = requests.get(f"https://api.test:{https_port}/echo-auth", timeout=20).text
def refused(url):
    try:
        urllib.request.urlopen(url, timeout=20).read()
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
    except Exception as e:
        return [0, type(e).__name__ + ": " + str(e)]
    return [200, "allowed"]
out["other"] = refused(f"http://other.test:{http_port}/")
out["metadata_name"] = refused(f"http://metadata.test:{http_port}/")
out["metadata_ip"] = refused("http://169.254.169.254/latest/meta-data/")
out["literal"] = refused(f"http://127.0.0.2:{http_port}/")
out["https_other"] = refused(f"https://other.test:{https_port}/")
out["redirect"] = refused(f"http://pkg.test:{http_port}/redirect?to=http://169.254.169.254/")
print(json.dumps(out))
"""

NO_ROUTE = """
import json, socket, sys
out = {}
for name, target in [("server", ("127.0.0.2", int(sys.argv[1]))), ("metadata", ("169.254.169.254", 80)),
                     ("public", ("93.184.216.34", 443)), ("v6", ("::1", int(sys.argv[1])))]:
    try:
        socket.create_connection(target, timeout=3).close()
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
try:
    socket.getaddrinfo("pkg.test", 80)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
print(json.dumps(out))
"""


def test_allowed_requests_work_and_everything_else_is_refused(
    egress_tier: str, local: Servers, libraries: bytes
) -> None:
    with capture_audit() as audit:
        backend = AuditedBackend(_registry.backend(egress_tier), audit, run_id="egress")
        hosts = (f"pkg.test:{local.http_port}", f"metadata.test:{local.http_port}")
        with Sandbox.create(backend=backend, limits=LIMITS, network=local.policy(allow_hosts=hosts)) as sbx:
            sbx.instance.execute(PutArchive(data=libraries))
            sbx.files.write("clients.py", CLIENTS)
            r = sbx.commands.run(f"python3 clients.py {local.http_port} {local.https_port}")
            assert r.exit_code == 0, r.stderr
            out = json.loads(r.stdout)
            pip = sbx.commands.run(
                "PYTHONPATH=/workspace/lib python3 -m pip --disable-pip-version-check --no-cache-dir install "
                f"--target /workspace/site --index-url http://pkg.test:{local.http_port}/simple/ "
                f"--trusted-host pkg.test:{local.http_port} tinypkg "
                "&& PYTHONPATH=/workspace/site python3 -c 'import tinypkg; print(tinypkg.VALUE)'",
                timeout_s=400,  # pip is slow under the microVM's emulated CPU (minutes under TCG)
            )
            assert pip.exit_code == 0 and pip.stdout.strip().endswith("42"), pip.stdout + pip.stderr
            sbx.files.write("noroute.py", NO_ROUTE)
            routes = json.loads(sbx.commands.run(f"python3 noroute.py {local.http_port}").stdout)
            leaks = sbx.commands.run(LEAK_SCAN, timeout_s=60)
    assert out["urllib_http"] == "http hello /a" and out["requests_http"] == "http hello /b"
    assert out["urllib_https"] == out["requests_https"] == "https authorized=True"
    assert TOKEN not in out["echo"] and "[REDACTED]" in out["echo"]  # a server echoing it back
    assert f"Bearer {TOKEN}" in local.https_seen.authorizations  # the token reached the server
    for case in ("other", "metadata_name", "metadata_ip", "literal", "redirect"):
        code, text = out[case]
        assert code == 403 and "stockade egress:" in text and "(rule: " in text, (case, text)
    assert "is a link-local address" in out["metadata_name"][1]
    assert out["https_other"][0] in (0, 403)  # CONNECT refused: urllib raises a tunnel error
    assert "403" in out["https_other"][1] or out["https_other"][0] == 403
    assert set(routes.values()) <= {"OSError", "gaierror", "ConnectionRefusedError", "TimeoutError"}, routes
    assert "connected" not in routes.values() and routes["dns"] == "gaierror"
    assert leaks.exit_code == 0 and leaks.stdout.strip() == "clean", leaks.stdout + leaks.stderr
    # Every request is an audit event; the token is in none of them.
    egress = audit.of(EventKind.EGRESS)
    assert {e.attributes["decision"] for e in egress} == {"allow", "deny"}
    assert any(e.attributes["credential_name"] == "api" for e in egress)
    assert all(TOKEN not in json.dumps(e.attributes) for e in audit.events)


# Looks for the token everywhere code can look: every process's environment and memory (of
# those it may read), and every file the sandbox was given or could write.
LEAK_SCAN = f"""python3 - <<'EOF'
import os, re
token = {TOKEN[::-1]!r}[::-1].encode()  # only this process holds it whole: not searched
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) == os.getpid():
        continue
    try:
        if token in open(f"/proc/{{pid}}/environ", "rb").read():
            found.append(("environ", pid))
        mem = open(f"/proc/{{pid}}/mem", "rb", 0)
        for line in open(f"/proc/{{pid}}/maps"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1] or end - start > 1 << 30:
                continue
            try:
                mem.seek(start)
                if token in mem.read(end - start):
                    found.append(("memory", pid, line.split()[-1]))
            except (OSError, OverflowError, ValueError):
                pass
    except OSError:
        pass
for top in ("/workspace", "/tmp", "/dev/shm", "/etc", "/run", "/opt"):  # the rest is the read-only image
    for folder, dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if token in open(path, "rb").read():
                    found.append(("file", path))
            except OSError:
                pass
print(found if found else "clean")
EOF"""


def test_curl_goes_through_the_proxy(egress_tier: str, local: Servers) -> None:
    with _sandbox(egress_tier, local.policy()) as sbx:
        has_curl = sbx.commands.run("command -v curl").exit_code == 0
        require("curl", has_curl, f"not in the {egress_tier} tier's image (scripts/build-image.sh)")
        r = sbx.commands.run(
            f"curl -sS http://pkg.test:{local.http_port}/c && echo && "
            f"curl -sS https://api.test:{local.https_port}/auth && echo && "
            f"curl -sS -o /dev/null -w '%{{http_code}}' http://other.test:{local.http_port}/; echo; "
            f"curl -sS https://other.test:{local.https_port}/ 2>&1; echo"
        )
    lines = r.stdout.splitlines()
    assert lines[:3] == ["http hello /c", "https authorized=True", "403"], r.stdout + r.stderr
    assert "403" in lines[3]  # curl: CONNECT tunnel failed, response 403


def test_a_server_that_echoes_the_credential_where_the_proxy_refuses_gets_none_of_it_to_the_code(
    egress_tier: str, local: Servers
) -> None:
    """The proxy's own refusals of a credentialed server's reply (a coding it cannot undo, a
    redirect to a refused host, scheme or no host) name the field, never its value: a server
    that puts there the secret it was sent hands no form of it to the code (exact, lowercased
    as some messages did, uppercased), nor to the audit trail, which names the credential."""
    with capture_audit() as audit:
        backend = AuditedBackend(_registry.backend(egress_tier), audit, run_id="echo")
        with Sandbox.create(backend=backend, limits=LIMITS, network=local.policy(MIXED_TOKEN)) as sbx:
            seen = {
                how: sbx.commands.run(
                    f"curl -s -i 'https://api.test:{local.https_port}/echo-auth-as?as={how}'", timeout_s=60
                ).stdout
                for how in REFUSED_ECHOES
            }
    assert f"Bearer {MIXED_TOKEN}" in local.https_seen.authorizations  # the server had it to echo
    forms = (MIXED_TOKEN, MIXED_TOKEN.lower(), MIXED_TOKEN.upper())
    for how, text in seen.items():
        refusal = text.rpartition("HTTP/1.1 ")[2]  # after the tunnel's "200 Connection established"
        assert refusal.startswith(("502 stockade egress:", "403 stockade egress:")), (how, text)
        assert not any(form in text for form in forms), (how, text)
    trail = [json.dumps(e.attributes) for e in audit.events]
    assert not any(form in event for form in forms for event in trail)
    egress = [e.attributes for e in audit.of(EventKind.EGRESS)]
    refusals = [r for r in egress if "echo-auth-as" in str(r["path"])]
    assert len(refusals) == len(REFUSED_ECHOES)
    # each reached the server, with the credential: "allow", the refusal in the rule and reason
    assert all(r["decision"] == "allow" and r["credential_name"] == "api" for r in refusals), refusals
    assert all(str(r["reason"]).startswith("the server answered") for r in refusals), refusals


def test_uploads_that_reached_the_server_and_ended_early_keep_their_bytes_and_credential(
    egress_tier: str, local: Servers
) -> None:
    """A credentialed upload whose server redirects to a host the policy refuses, and one cut
    mid-body by the byte limit: the server had each with the credential, and the trail says
    so ("allow", the bytes that went, the credential's name), not "deny, 0 bytes"."""
    mib, port = 1024 * 1024, local.https_port
    before = len(local.https_seen.received)
    post = "head -c {n} /dev/zero | curl -s -o /dev/null -w '%{{http_code}} ' -H 'Expect:' "
    post += "--data-binary @- '{url}'"
    with capture_audit() as audit:
        backend = AuditedBackend(_registry.backend(egress_tier), audit, run_id="early")
        network = local.policy(max_bytes_per_minute=3 * mib)
        with Sandbox.create(backend=backend, limits=LIMITS, network=network) as sbx:
            has_curl = sbx.commands.run("command -v curl").exit_code == 0
            require("curl", has_curl, f"not in the {egress_tier} tier's image (scripts/build-image.sh)")
            redirect = post.format(n=mib, url=f"https://api.test:{port}/redirect?to=https://other.test/next")
            upload = post.format(n=8 * mib, url=f"https://api.test:{port}/upload")
            r = sbx.commands.run(f"{redirect}; {upload}", timeout_s=120)
    assert r.stdout.startswith("403 "), r.stdout + r.stderr
    wait_for(lambda: len(local.https_seen.received) >= before + 2, what="the server to see both uploads")
    redirected, cut = local.https_seen.received[before : before + 2]
    posts = [e.attributes for e in audit.of(EventKind.EGRESS) if e.attributes["method"] == "POST"]
    assert [(p["status"], p["decision"], p["credential_name"]) for p in posts] == [
        (403, "allow", "api"),
        (429, "allow", "api"),
    ], posts
    assert redirected == mib and posts[0]["bytes_out"] == mib, (redirected, posts)
    sent = posts[1]["bytes_out"]
    assert posts[1]["rule"] == "max_bytes_per_minute" and isinstance(sent, int) and 0 < cut <= sent < 3 * mib


def test_a_credentialed_reply_hides_the_secret_in_no_header_name_nor_behind_a_listed_coding(
    egress_tier: str, local: Servers
) -> None:
    """What an outside attack got to code (2026-12-05): the secret as a header's name (bare,
    hex, URL-safe base64), and the echo gzipped behind a ``Content-Encoding: identity``
    first, which ``curl --compressed`` decompressed; and (a review, 2026-12-07) the echo
    lowercased or uppercased, and in a second gzip member. Code reads no form of it now."""
    hows = [*HEADER_NAME_ECHOES, "identity-then-gzip", "lower", "upper", "gzip-members"]
    with _sandbox(egress_tier, local.policy(MIXED_TOKEN)) as sbx:
        has_curl = sbx.commands.run("command -v curl").exit_code == 0
        require("curl", has_curl, f"not in the {egress_tier} tier's image (scripts/build-image.sh)")
        seen = {
            how: sbx.commands.run(
                f"curl -s -i --compressed 'https://api.test:{local.https_port}/echo-auth-as?as={how}'",
                timeout_s=60,
            ).stdout
            for how in hows
        }
    assert f"Bearer {MIXED_TOKEN}" in local.https_seen.authorizations  # the server had it to echo
    forms = [HEADER_NAME_ECHOES[how](MIXED_TOKEN)[2:].lower() for how in HEADER_NAME_ECHOES]
    for how, text in seen.items():
        assert text.rpartition("HTTP/1.1 ")[2].startswith("200"), (how, text)
        assert not any(form in text.lower() for form in forms), (how, text)
    assert seen["identity-then-gzip"].endswith("you sent: [REDACTED]"), seen
    assert seen["gzip-members"].endswith("you sent: [REDACTED]"), seen
    assert all(MIXED_TOKEN.lower() not in text.lower() for text in seen.values()), seen


def test_a_tunnel_to_an_allowed_host_with_another_sni_is_closed(egress_tier: str, local: Servers) -> None:
    code = f"""
import socket, ssl
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(b"CONNECT api.test:{local.https_port} HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
try:
    ctx.wrap_socket(s, server_hostname="other.test")
    print("handshake")
except (OSError, ssl.SSLError) as e:
    print("closed")
"""
    with _sandbox(egress_tier, local.policy(credentials=())) as sbx:
        sbx.files.write("sni.py", code)
        r = sbx.commands.run("python3 sni.py")
    assert r.stdout.splitlines() == ["HTTP/1.1 200 Connection established", "closed"], r.stdout + r.stderr


def test_the_proxy_dies_with_the_sandbox(egress_tier: str, local: Servers) -> None:
    sbx = _sandbox(egress_tier, local.policy())
    boundary = sbx.instance.boundary  # type: ignore[attr-defined]
    attachment = boundary.egress
    socket_path = attachment.socket_path
    assert socket_path.exists()
    sbx.close()
    assert not socket_path.exists() and attachment.proxy.ca is None and not attachment.proxy.gate.secrets


def _agent_policy(local: Servers, folder: Path) -> Path:
    """api.test with its credential (from $EGRESS_TEST_API_TOKEN) for role ci; role reader
    gets the host but no credential."""
    policy = folder / "policy.toml"
    policy.write_text(
        f"""
[trust]
level = "trusted"
[network]
allow = [{{ host = "api.test", ports = [{local.https_port}] }}]
allow_addresses = ["127.0.0.3/32"]
resolve = {{ "api.test" = ["127.0.0.3"] }}
upstream_ca = "{local.ca_file}"
[credentials.api]
source = "env:EGRESS_TEST_API_TOKEN"
hosts = ["api.test"]
[roles.ci]
credentials = ["api"]
[roles.reader]
"""
    )
    return policy


def test_an_agent_gets_its_roles_credential_through_the_proxy(
    local: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_agent: the policy's [network] and [credentials], bound by the role, on the
    process tier; the egress events are in the audit trail, the token nowhere in it."""
    require_tier("process")
    from stockade.agent import RunLimits, RunStatus
    from stockade.assembly import AgentConfig, build_agent
    from stockade.audit import AuditLog, SQLiteStore
    from stockade.models import ScriptedModel, tool_call

    monkeypatch.setenv("EGRESS_TEST_API_TOKEN", TOKEN)
    policy = _agent_policy(local, tmp_path)
    code = f"import urllib.request; print(urllib.request.urlopen('https://api.test:{local.https_port}/auth').read())"
    store = SQLiteStore(tmp_path / "audit.db")
    # The reader gets no credential, so no opened TLS: a tunnel to a server its sandbox does
    # not trust (the test CA is not in it), where the ci role's proxy answered with its own CA.
    for role, expected in (("ci", "authorized=True"), ("reader", "certificate")):
        model = ScriptedModel([tool_call("run_code", {"code": code, "language": "python"}), "done"])
        config = AgentConfig(
            model=model,
            policy=policy,
            role=role,
            tier="process",
            audit=AuditLog(store, flush_interval_s=None),
            limits=RunLimits(max_steps=4),
            approval_dir=tmp_path / "approvals",
            kill_target=str(tmp_path / "kill"),
        )
        with build_agent(config) as agent, agent.session(workspace=None, run_id=f"run-{role}") as session:
            result = session.run_sync("call the API")
        assert result.status == RunStatus.SUCCESS, result
        outputs = [m for m in result.state.messages if expected in repr(m)]
        assert outputs, (role, result.state.messages)
    events = [e for e in store.events() if e.kind == EventKind.EGRESS]
    by_run = {(e.run_id, e.attributes["method"], e.attributes["credential_name"]) for e in events}
    assert ("run-ci", "GET", "api") in by_run and ("run-reader", "CONNECT", "") in by_run
    assert not any(run == "run-reader" and name for run, _, name in by_run)
    assert TOKEN.encode() not in (tmp_path / "audit.db").read_bytes()


# Code that keeps calling the API with the role's credential: slow streamed answers (one
# chunk every 0.1 s for a second), one after the other, until the run is killed.
STREAMING = """
import urllib.request
url = "https://api.test:{port}/stream?chunks=10&every=0.1"
while True:
    with urllib.request.urlopen(url, timeout=30) as answer:
        for line in answer:
            pass
"""

# A request the proxy had already sent upstream when the switch acted may reach the server's
# handler a little later (its thread is scheduled on a loaded machine): this long after the
# kill, the server has seen every such request. Any credential it sees later came after the kill.
IN_FLIGHT_S = 0.5
# The server notices a cut stream at one of its next writes (one every 0.1 s): well before the
# answer would have ended (1 s after it began), though a loaded machine may be slow to say so.
CUT_WITHIN_S = 1.0


def _attachment(instance: object) -> Any:
    """The egress attachment of the tier's instance under the run's wrappers."""
    while not hasattr(instance, "boundary"):
        instance = instance.wrapped  # type: ignore[attr-defined]
    return instance.boundary.egress


@pytest.mark.process
def test_a_killed_runs_credential_is_cut_mid_request(
    local: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's kill switch, pulled while code in its sandbox streams answers from the API
    with the role's credential: the proxy closes the moment the switch acts, not when the
    tool call ends. The request in flight is cut, no credentialed request reaches the server
    after the kill, the proxy's socket and secrets are gone, and the audit trail verifies."""
    require_tier("process")
    from stockade.agent import RunLimits, RunStatus
    from stockade.assembly import AgentConfig, build_agent
    from stockade.audit import AuditLog, SQLiteStore, verify
    from stockade.models import ScriptedModel, tool_call
    from stockade.runtime.events import KillRequested, RuntimeEvent
    from stockade.runtime.killswitch import FileKillSource

    monkeypatch.setenv("EGRESS_TEST_API_TOKEN", TOKEN)
    run_id = "run-egress-kill"
    kill_dir = tmp_path / "kill"
    code = STREAMING.format(port=local.https_port)
    model = ScriptedModel([tool_call("run_code", {"code": code, "language": "python"}), "done"])
    before = len(local.https_seen.hits)
    found: dict[str, Any] = {}

    def credentialed() -> list[float]:
        return [h.at for h in local.https_seen.hits[before:] if h.authorization == f"Bearer {TOKEN}"]

    def at_kill(event: RuntimeEvent) -> None:
        # Called by the switch right after it closed the run's sandbox: what is left of the
        # proxy at the kill moment, before the tool call has even returned.
        if isinstance(event, KillRequested):
            found["killed_at"] = time.monotonic()
            attachment = found["attachment"]
            found["socket_at_kill"] = attachment.socket_path.exists()
            found["secrets_at_kill"] = bool(attachment.proxy.gate.secrets)
            found["ca_at_kill"] = attachment.proxy.ca

    def pull() -> None:
        # Mid-request: after the server has seen the credential a few times (three answers).
        # Pulled even if they never come, so the run ends (the assertions below then say why).
        try:
            wait_for(
                lambda: len(credentialed()) >= 3,
                what="three credentialed requests at the server",
                timeout_s=120,
                interval_s=0.05,
            )
            time.sleep(0.3)  # into the third answer's stream
        finally:
            found["pulled_at"] = time.monotonic()
            FileKillSource(kill_dir).kill(run_id, "test: pulled mid-request")  # as `stockade kill` does

    store = SQLiteStore(tmp_path / "audit.db")
    config = AgentConfig(
        model=model,
        policy=_agent_policy(local, tmp_path),
        role="ci",
        tier="process",
        audit=AuditLog(store, flush_interval_s=None),
        limits=RunLimits(max_steps=4),
        approval_dir=tmp_path / "approvals",
        kill_target=str(kill_dir),
        runtime_observers=[at_kill],
    )
    killer = threading.Thread(target=pull, name="test-kill", daemon=True)
    with build_agent(config) as agent, agent.session(workspace=None, run_id=run_id) as session:
        found["attachment"] = _attachment(session.sandbox.instance)
        killer.start()
        result = session.run_sync("stream from the API")
    killer.join(10)
    time.sleep(IN_FLIGHT_S)  # a straggler would have reached the server by now
    assert result.status == RunStatus.KILLED, result
    assert "pulled mid-request" in (result.error or ""), result.error
    pulled_at, killed_at = found["pulled_at"], found["killed_at"]
    # the switch acted within a few polls (every 0.1 s) of being pulled, mid-call
    assert killed_at - pulled_at < 2.0, killed_at - pulled_at
    # At the kill moment the proxy was already closed: socket gone, credentials and CA dropped.
    assert found["socket_at_kill"] is False and found["secrets_at_kill"] is False
    assert found["ca_at_kill"] is None
    hits = credentialed()
    assert len([at for at in hits if at < pulled_at]) >= 3, hits  # the credential got through before
    late = [at - killed_at for at in hits if at > killed_at + IN_FLIGHT_S]
    assert late == [], f"credentialed requests {late} s after the kill"
    # The answer streaming at the kill lost its client (the proxy) before its last chunk.
    cut = [at - pulled_at for at in local.https_seen.cut if at >= pulled_at]
    assert cut and min(cut) < killed_at - pulled_at + CUT_WITHIN_S, (cut, killed_at - pulled_at)
    # Nothing listens any more where the sandbox reached its proxy.
    attachment = found["attachment"]
    assert not attachment.socket_path.exists() and not attachment.folder.exists()
    with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(attachment.socket_path))
    assert not attachment.proxy.serving
    # Cutting the connections in flight is the proxy's way to close, not an error of its loop.
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    # The trail holds the credentialed requests and the kill, verifies, and never the token.
    report = verify(store)
    assert report.ok, report
    events = list(store.events(run_id=run_id))
    egress = [e.attributes for e in events if e.kind == EventKind.EGRESS]
    credentialed_records = [a for a in egress if a["credential_name"] == "api"]
    in_flight = [a for a in credentialed_records if "closed mid-request" in str(a["reason"])]
    done = [a for a in credentialed_records if a["status"] == 200 and a not in in_flight]
    assert len(done) >= 2, egress  # the answers streamed to their end before the kill
    # the one streaming at the kill: the server's 200 the code had, and what it had of the body
    assert len(in_flight) == 1 and in_flight[0]["status"] == 200, egress
    assert isinstance(in_flight[0]["bytes_in"], int) and in_flight[0]["bytes_in"] > 0, egress
    assert any(e.kind == EventKind.KILL_SWITCH for e in events)
    assert TOKEN.encode() not in (tmp_path / "audit.db").read_bytes()


def test_a_service_sandbox_gets_the_tenants_rules_and_credential_for_the_hosts_it_names(
    local: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stockade serve: a remote sandbox names hosts; the tenant's policy gives their rules
    and the role's credential, added by the proxy in the server's process."""
    require_tier("process")
    from stockade import exceptions as exc
    from stockade.client import Client, RemoteSandbox
    from tests.integration.service_env import Server, write_tenants

    monkeypatch.setenv("EGRESS_TEST_API_TOKEN", TOKEN)  # the server's environment: the host's
    tenants, tokens = write_tenants(tmp_path)
    (tmp_path / "policy.toml").write_text(
        f"""version = 1
[trust]
level = "trusted"
[network]
allow = [{{ host = "api.test", ports = [{local.https_port}] }}]
allow_addresses = ["127.0.0.3/32"]
resolve = {{ "api.test" = ["127.0.0.3"] }}
upstream_ca = "{local.ca_file}"
[credentials.api]
source = "env:EGRESS_TEST_API_TOKEN"
hosts = ["api.test"]
roles = ["dev"]
[roles.dev]
tiers = ["process"]
[roles.viewer]
tiers = ["process"]
"""
    )
    server = Server(tenants, f"sqlite:///{tmp_path / 'service.db'}", tmp_path)
    try:
        with Client(server.url, tokens.acme) as client:
            with pytest.raises(exc.PolicyDenied, match=r"api\.test"):
                RemoteSandbox.create(tier="process", network=NetworkPolicy(allow_hosts=("pkg.test",)),
                                     client=client)  # fmt: skip
            network = NetworkPolicy(allow_hosts=("api.test",))
            with RemoteSandbox.create(tier="process", limits=LIMITS, network=network, client=client) as sbx:
                url = f"https://api.test:{local.https_port}/auth"
                fetch = f"import urllib.request; print(urllib.request.urlopen('{url}').read())"
                r = sbx.commands.run(f'python3 -c "{fetch}"; env')
        assert "authorized=True" in r.stdout, r.stdout + r.stderr
        assert TOKEN not in r.stdout + r.stderr
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()[-3000:]


def test_a_snapshot_keeps_the_allowlist_but_not_credentials(local: Servers, tmp_path: Path) -> None:
    """A fork from a files snapshot goes out through a proxy of its own, with the same rules;
    a sandbox holding credentials is not snapshotted (a credential's source may be the secret)."""
    require_tier("process")
    store = SnapshotStore(tmp_path / "snapshots")
    with _sandbox("process", local.policy()) as sbx, pytest.raises(LimitNotEnforceable, match="credentials"):
        sbx.snapshot(store=store)
    code = f"""
import urllib.error, urllib.request
print(urllib.request.urlopen("http://pkg.test:{local.http_port}/s", timeout=20).read().decode())
try:
    urllib.request.urlopen("http://other.test:{local.http_port}/", timeout=20)
except urllib.error.HTTPError as err:
    print(err.code)
"""
    with _sandbox("process", local.policy(credentials=())) as sbx:
        sbx.files.write("get.py", code)
        snap = sbx.snapshot(store=store)
    assert TOKEN not in json.dumps(store.load(snap).spec)
    with Sandbox.create(snapshot=snap, store=store) as fork:
        r = fork.commands.run("python3 get.py")
    assert r.stdout.split() == ["http", "hello", "/s", "403"], r.stdout + r.stderr


def _restored(sandbox: Sandbox) -> bool:
    """Whether the microVM's QEMU started from a saved state (a boot image or a snapshot)
    rather than booting its kernel."""
    named = host_processes(f"stockade-{sandbox.id}\0".encode())  # QEMU, and bwrap: its jail
    (pid,) = [pid for pid in named if Path(f"/proc/{pid}/comm").read_bytes().startswith(b"qemu")]
    return b"\0-incoming\0" in Path(f"/proc/{pid}/cmdline").read_bytes()


GET_HTTP = """
import sys, urllib.request
print(urllib.request.urlopen(f"http://pkg.test:{sys.argv[1]}/m", timeout=20).read().decode())
"""
URLLIB = """
import sys, urllib.error, urllib.request
http_port, https_port = sys.argv[1], sys.argv[2]
print(urllib.request.urlopen(f"http://pkg.test:{http_port}/m", timeout=20).read().decode())
print(urllib.request.urlopen(f"https://api.test:{https_port}/auth", timeout=20).read().decode())
try:
    urllib.request.urlopen(f"http://other.test:{http_port}/", timeout=20)
except urllib.error.HTTPError as err:
    print(err.code)
"""


def test_a_microvm_with_an_allowlist_starts_from_an_image_and_keeps_files_only(
    local: Servers, tmp_path: Path, microvm_boot_images: BootImages
) -> None:
    """An image's guest (a boot image's, a ready image's, a QEMU started ahead) has an egress
    port with nothing behind it: the sandbox's own proxy goes behind it when the guest becomes
    the sandbox, and its relay is configured at the handshake (boot image) or after the
    resume (ready image), with its own trust bundle and variables: HTTP, HTTPS with its
    credential, and refusals as from a cold boot. Its relay's streams live half in the guest,
    half in this process: its snapshot keeps files, and its fork is a new sandbox."""
    require_tier("microvm")
    from stockade.sandbox import microvm
    from stockade.sandbox._microvm_instance import VMInstance

    def started_from(sandbox: Sandbox) -> str:
        assert isinstance(sandbox.instance, VMInstance)
        return sandbox.instance.started_from

    store = SnapshotStore(tmp_path / "snapshots")
    backend = microvm.MicroVMBackend(snapshot_store=microvm_boot_images(tmp_path / "images"))
    run = f"python3 get.py {local.http_port} {local.https_port}"
    expected = ["http", "hello", "/m", "https", "authorized=True", "403"]
    try:
        with Sandbox.create("microvm", backend=backend, limits=LIMITS, network=local.policy()) as sbx:
            assert _restored(sbx) and started_from(sbx) == "boot image", backend._boot_failed
            sbx.files.write("get.py", URLLIB)
            r = sbx.commands.run(run)
            assert r.stdout.split() == expected, r.stdout + r.stderr
        backend.wait_ahead(180)
        for _ in range(2):  # the second from the QEMU started ahead on the ready image
            with Sandbox.create("microvm", backend=backend, limits=LIMITS, network=local.policy()) as sbx:
                assert started_from(sbx) == "ready image", backend._ready.refused
                sbx.files.write("get.py", URLLIB)
                r = sbx.commands.run(run)
                assert r.stdout.split() == expected, r.stdout + r.stderr
                # the interpreter's child: the variables and the trust bundle reach it too
                child = f"import subprocess as s\ns.run({run!r}, shell=True, capture_output=True, text=True)"
                assert sbx.run_code(f"{child}.stdout.split()").text == repr(expected)
                sbx.reset()  # a fresh supervisor configures its relay again
                sbx.files.write("get.py", URLLIB)
                r = sbx.commands.run(run)
                assert r.stdout.split() == expected, r.stdout + r.stderr
        with Sandbox.create(
            "microvm", backend=backend, limits=LIMITS, network=local.policy(credentials=())
        ) as sbx:
            sbx.files.write("get.py", GET_HTTP)
            sbx.run_code("x = 41")
            with pytest.raises(LimitNotEnforceable, match="egress allowlist keeps files only"):
                sbx.snapshot(store=store, memory=True)
            snap = sbx.snapshot(store=store)
    finally:
        backend.close()
    assert snap.kind is SnapshotKind.FILES and snap.tier == "microvm"
    with Sandbox.create(snapshot=snap, store=store) as fork:
        assert fork.run_code("'x' in globals()").text == "False"  # a new interpreter
        r = fork.commands.run(f"python3 get.py {local.http_port}")
    assert r.stdout.split() == ["http", "hello", "/m"], r.stdout + r.stderr  # its own proxy, same rules


def test_a_microvm_whose_egress_port_broke_the_protocol_is_closed_never_reset(local: Servers) -> None:
    """Frames no honest relay sends (tests/unit/egress/test_mux.py sends each) cut the port,
    and the sandbox ran on without a way out: a pool's reset then asked the same supervisor,
    no longer ours (only guest root sends such frames), to make the sandbox fresh for its
    next user, and the violation was told to no one. Now the next op closes the sandbox."""
    require_tier("microvm")
    from stockade.exceptions import SandboxClosed, SandboxCrashed

    with (
        capture_audit() as audit,
        Sandbox.create(
            backend=AuditedBackend(_registry.backend("microvm"), audit, run_id="run-1"),
            limits=LIMITS,
            network=local.policy(credentials=()),
        ) as sbx,
    ):
        assert sbx.commands.run("true").exit_code == 0
        mux = _attachment(sbx.instance).mux
        mux.violation = "stream 3: a second EOF"  # what the mux records as it cuts the port
        with pytest.raises(SandboxCrashed, match="a second EOF") as crashed:
            sbx.reset()
        assert crashed.value.cause == "protocol"
        with pytest.raises(SandboxClosed):
            sbx.commands.run("true")
    told = [e for e in audit.of(EventKind.SANDBOX_RESET) if "a second EOF" in json.dumps(e.attributes)]
    assert told, [e.attributes for e in audit.events]


# How a program's connection to the relay's port was made: the connect shortcut's is a Unix
# socket (the proxy's, bound in), the relay's a TCP connection over the sandbox's loopback.
HOW_CONNECTED = """
import json, socket, sys, urllib.error, urllib.request
s = socket.create_connection(("127.0.0.1", 3128))
domain = s.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
s.close()
answer = urllib.request.urlopen(f"http://pkg.test:{sys.argv[1]}/s", timeout=20).read().decode()
try:
    urllib.request.urlopen(f"http://other.test:{sys.argv[1]}/", timeout=20)
    refused = "allowed"
except urllib.error.HTTPError as e:
    refused = e.code
print(json.dumps(["unix" if domain == socket.AF_UNIX else "tcp", answer, refused]))
"""


@pytest.mark.gvisor
@pytest.mark.parametrize("mode", ["docker", "runsc"])
def test_on_gvisor_programs_reach_the_proxys_socket_without_the_relay(mode: str, local: Servers) -> None:
    from stockade.sandbox.gvisor import GVisorBackend

    require_tier("gvisor")
    backend = GVisorBackend(mode=mode)  # type: ignore[arg-type]
    report = backend.probe()
    require(f"gVisor ({mode})", report.available, report.detail)
    with Sandbox.create(backend=backend, limits=LIMITS, network=local.policy(credentials=())) as sbx:
        sbx.files.write("how.py", HOW_CONNECTED)
        command = sbx.commands.run(f"python3 how.py {local.http_port}")
        # A program without the shortcut (a static one, or one that drops it) takes the relay.
        relayed = sbx.commands.run(f"env -u LD_PRELOAD python3 how.py {local.http_port}")
        # The interpreter run_code forks from the supervisor has it too.
        code = sbx.run_code(
            f"import sys; sys.argv = ['how', '{local.http_port}']\nexec(open('how.py').read())"
        )
    assert json.loads(command.stdout) == ["unix", "http hello /s", 403], command.stdout + command.stderr
    assert json.loads(relayed.stdout) == ["tcp", "http hello /s", 403], relayed.stdout + relayed.stderr
    assert json.loads(code.logs.stdout) == ["unix", "http hello /s", 403], code


# A connection left open through the relay by the last user's code, from a thread of its
# interpreter (which lives until the reset): its request half sent.
HALF_REQUEST = """
import socket, threading, time
def hold():
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"GET http://pkg.test:{port}/left-open HTTP/1.1\\r\\nHost: pkg.test\\r\\n")
    time.sleep(600)
threading.Thread(target=hold, daemon=True).start()
time.sleep(0.5)
"""


def test_a_reset_renews_the_relay_in_place_for_the_next_user(egress_tier: str, local: Servers) -> None:
    """A sandbox with an allowlist resets in place (its zygote stays: no fresh supervisor, two
    interpreter starts, seconds on the microVM), its relay renewed: the last user's
    connections closed, its trust files written again after /tmp was emptied (HTTPS, with
    the credential, still works), and the policy as before."""
    run = f"python3 get.py {local.http_port} {local.https_port}"
    expected = ["http", "hello", "/m", "https", "authorized=True", "403"]
    with _sandbox(egress_tier, local.policy()) as sbx:
        zygote = sbx.run_code("import os; os.getppid()").text
        assert sbx.run_code(HALF_REQUEST.format(port=local.http_port)).error is None
        for user in range(3):
            sbx.reset()
            assert sbx.run_code("import os; os.getppid()").text == zygote, "a fresh supervisor: not in place"
            sbx.files.write("get.py", URLLIB)
            r = sbx.commands.run(run)
            assert r.stdout.split() == expected, (user, r.stdout + r.stderr)
        assert "/left-open" not in local.http_seen.paths, "the last user's request went on"


class Rotating:
    """A secret source whose value the test rotates, or makes unreadable (a vault down)."""

    def __init__(self, value: str) -> None:
        self.value: str | None = value
        self.reads = 0

    def read(self) -> str:
        self.reads += 1
        if self.value is None:
            raise ConnectionError("the vault is down")
        return self.value


def test_a_pools_next_user_gets_the_credential_as_its_source_says_now(
    egress_tier: str, local: Servers
) -> None:
    """A member kept the value its proxy read when it started, for every later user (up to
    ``max_uses``): a secret rotated, the old one revoked, was still sent. A reset reads it
    again; a source that cannot be read has the member replaced, and the acquirer told."""
    source = Rotating("OLD-SECRET")
    policy = local.policy(credentials=(Credential(name="api", hosts=("api.test",), source=source),))
    fetch = f"curl -sS https://api.test:{local.https_port}/auth"
    with SandboxPool(egress_tier, size=1, limits=LIMITS, network=policy) as pool:
        with pool.acquire() as sbx:
            first = sbx.id
            assert sbx.commands.run(fetch).stdout == "https authorized=True", "curl in the image?"
            assert local.https_seen.authorizations[-1] == "Bearer OLD-SECRET"
        source.value = "NEW-SECRET"  # rotated: the old one revoked
        for _ in range(2):
            with pool.acquire() as sbx:
                assert sbx.id == first, f"replaced, not reset: {pool.stats().last_replaced_why}"
                assert sbx.commands.run(fetch).stdout == "https authorized=True"
                assert local.https_seen.authorizations[-1] == "Bearer NEW-SECRET"
        source.value = None
        wait_for(lambda: pool.stats().replaced == 1, what="the member to be replaced", timeout_s=60)
        assert "ConnectionError" in pool.stats().last_replaced_why
        with pytest.raises(SandboxStartError, match="credential 'api'"), pool.acquire(timeout_s=30):
            pass
        source.value = "NEWER-SECRET"  # back: the pool fills again
        wait_for(lambda: pool.stats().ready == 1, what="a new member", timeout_s=60)
        with pool.acquire() as sbx:
            assert sbx.commands.run(fetch).stdout == "https authorized=True"
            assert local.https_seen.authorizations[-1] == "Bearer NEWER-SECRET"


class Held(Rotating):
    """A ``Rotating`` source that hangs while the test holds it (a vault that stopped
    replying)."""

    def __init__(self, value: str) -> None:
        super().__init__(value)
        self.answers = threading.Event()
        self.answers.set()

    def read(self) -> str:
        value = super().read()
        self.answers.wait(60)
        return self.value or value


def _secret_readers() -> int:
    return sum(t.name == "stockade-egress-secrets" for t in threading.enumerate())


def test_a_pool_whose_credential_source_hangs_keeps_one_read_of_it_and_recovers(
    local: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each start the pool's refill retried (every half second after the deadline) and each
    reset started a read of the source of its own and left it running: a vault that stopped
    answering cost one more host thread, and one more read of the vault, every 10.5 s for
    as long as it hung (9 threads, 14 after 45 s). Now the starts and the reset wait on the
    one read still running; once the vault answers, the pool reads it again and fills."""
    require_tier("process")
    monkeypatch.setattr(_attach, "SECRETS_TIMEOUT_S", 0.3)  # the starts' and the resets' deadline
    source = Held("OLD-SECRET")
    policy = local.policy(credentials=(Credential(name="api", hosts=("api.test",), source=source),))
    fetch = f"curl -sS https://api.test:{local.https_port}/auth"
    before = _secret_readers()
    try:
        with SandboxPool("process", size=1, limits=LIMITS, network=policy) as pool:
            with pool.acquire() as sbx:
                assert sbx.commands.run(fetch).stdout == "https authorized=True", "curl on the host?"
            source.answers.clear()  # the vault hangs: the reset fails, the refill's starts too
            wait_for(lambda: pool.stats().replaced == 1, what="the member to be replaced", timeout_s=30)
            time.sleep(3)  # several starts of the refill's
            assert (source.reads, _secret_readers() - before) == (2, 1), "a read and a thread for each start"
            with (
                pytest.raises(SandboxStartError, match=r"credential 'api'.* not read in"),
                pool.acquire(timeout_s=5),
            ):
                pass
            source.value = "NEW-SECRET"
            source.answers.set()  # back: the pool fills again, with the value read now
            wait_for(lambda: pool.stats().ready == 1, what="a new member", timeout_s=30)
            with pool.acquire() as sbx:
                assert sbx.commands.run(fetch).stdout == "https authorized=True"
                assert local.https_seen.authorizations[-1] == "Bearer NEW-SECRET"
    finally:
        source.answers.set()


# The last user's code leaves K connections to the relay, on each a slow GET (answered after
# SLOW_S, or once the test releases it) with a POST pipelined behind it, and its quick GET's
# server connection kept.
SLOW_S = 10  # past the pipelining code's time out (4 s) and the reset after it, on a loaded host
PIPELINED = """
import socket, sys, time, urllib.request
port, k, slow = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
socks = []
for _ in range(k):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(
        f"GET http://pkg.test:{port}/slow?s={slow} HTTP/1.1\\r\\nHost: pkg.test\\r\\n\\r\\n"
        f"POST http://pkg.test:{port}/u1-POST HTTP/1.1\\r\\nHost: pkg.test\\r\\n"
        "Content-Length: 5\\r\\n\\r\\nhello".encode()
    )
    socks.append(s)
time.sleep(0.5)  # the slow GETs on their way: the quick one gets a server connection of its own
urllib.request.urlopen(f"http://pkg.test:{port}/u1-quick", timeout=20).read()
time.sleep(600)
"""

# The next user's requests, as many as the policy allows in a minute.
MANY_GETS = """
import sys, urllib.error, urllib.request
port, n = int(sys.argv[1]), int(sys.argv[2])
codes = []
for i in range(n):
    try:
        codes.append(urllib.request.urlopen(f"http://pkg.test:{port}/u2-{i}", timeout=20).status)
    except urllib.error.HTTPError as err:
        codes.append(err.code)
print(" ".join(map(str, codes)))
"""


def test_a_reset_cuts_the_last_users_requests_and_gives_the_next_a_fresh_budget(
    egress_tier: str, local: Servers
) -> None:
    """Nothing the last user pipelined reaches a server after the reset (the host's proxy
    is renewed with the relay: its connections and requests in flight cut), the next user
    has the whole budget per minute, and no server connection of the last user's is kept."""
    k = 8
    budget = 2 * k + 1  # the last user's quick GET and slow GETs, and its POSTs if they went
    seen = len(local.http_seen.paths)
    local.http_seen.slow_release.clear()
    ended = len(local.http_seen.slow_ended)
    with _sandbox(egress_tier, local.policy(max_requests_per_minute=budget)) as sbx:
        sbx.files.write("pipelined.py", PIPELINED)
        # Its time out ends the code (the relay then half-closes each connection to the proxy,
        # as a client that sent all it had); the reset comes well before the slow answers.
        sbx.commands.run(f"python3 pipelined.py {local.http_port} {k} {SLOW_S}", timeout_s=4)
        started = time.monotonic()
        assert local.http_seen.paths[seen:].count(f"/slow?s={SLOW_S}") == k
        sbx.reset()
        # the slow answers come SLOW_S after the GETs reached the server, within the 4 s before
        assert time.monotonic() - started < SLOW_S - 5, "the reset came after the slow answers"
        assert len(_attachment(sbx.instance).proxy.exchange.upstreams) == 0, "a server connection kept"
        sbx.files.write("many.py", MANY_GETS)
        codes = sbx.commands.run(f"python3 many.py {local.http_port} {budget}").stdout.split()
        assert codes == ["200"] * budget, "the last user's budget carried over"
        # The slow answers go out now, not at SLOW_S: the reset has come before them all the
        # same. A POST pipelined behind one would follow it over its server connection; once
        # each has ended, none can, and a second more is as long as the wait gave before.
        local.http_seen.slow_release.set()
        wait_for(
            lambda: (
                len(local.http_seen.slow_ended) - ended >= k or "/u1-POST" in local.http_seen.paths[seen:]
            ),
            what="the server connections of the slow answers to end",
            timeout_s=SLOW_S,
        )
        time.sleep(1)
        assert "/u1-POST" not in local.http_seen.paths[seen:], "the last user's request went out later"


# More connections to the relay at once than it carries (the proxy's 128), from two
# processes of the code's: how many of them were refused (closed, or answered) within 3 s.
MANY_CONNECTIONS = """
import os, select, socket, sys, time
for _ in range(2):
    if os.fork() == 0:
        socks = []
        for _ in range(100):
            try:
                socks.append(socket.create_connection(("127.0.0.1", 3128), timeout=5))
            except OSError:
                pass
        deadline, refused = time.monotonic() + 3, set()
        while len(refused) < len(socks) and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in socks if s not in refused], [], [], 0.2)
            refused.update(ready)
        print(len(socks), len(refused), flush=True)
        os._exit(0)
os.wait(); os.wait()
"""


def test_connections_past_what_the_relay_carries_wait_rather_than_being_refused(
    egress_tier: str, local: Servers
) -> None:
    """200 connections at once to the relay: those past what it carries wait in its backlog
    (none closed: before, each was accepted and closed at once, a reset for the code), the
    supervisor lives, and the sandbox still reaches its allowed hosts once they are closed.
    On gVisor a program reaches the host's proxy itself (no relay): past its
    ``MAX_CONNECTIONS`` the rest wait in its socket's backlog alike (before, they were
    answered 503 and closed). The microVM's relay (64 streams) leaves the rest in the
    listener's backlog, where a connect may wait past its 5 s once that is full."""
    with _sandbox(egress_tier, local.policy()) as sbx:
        sbx.files.write("many.py", MANY_CONNECTIONS)
        r = sbx.commands.run("python3 many.py", timeout_s=60)
        counts = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
        assert len(counts) == 2, r.stdout + r.stderr
        if egress_tier == "microvm":
            assert [closed for _, closed in counts] == [0, 0], counts
        else:
            assert counts == [(100, 0), (100, 0)], counts
        assert sbx.run_code("1 + 1").text == "2"
        sbx.files.write("get.py", MANY_GETS)
        assert sbx.commands.run(f"python3 get.py {local.http_port} 1").stdout.split() == ["200"]


# A package manager's burst: 100 requests from 50 threads, each on a connection of its own.
BURST = """
import concurrent.futures, sys, urllib.request
port = int(sys.argv[1])
def get(i):
    try:
        return urllib.request.urlopen(f"http://pkg.test:{port}/burst-{i}", timeout=60).status
    except Exception as err:
        return repr(err)
codes = list(concurrent.futures.ThreadPoolExecutor(50).map(get, range(100)))
print(sum(code == 200 for code in codes), [code for code in codes if code != 200][:3])
"""


def test_a_burst_of_fifty_connections_at_once_goes_through_at_default_limits(
    egress_tier: str, local: Servers
) -> None:
    """At the default Limits (128 descriptors a process) the relay carries as many
    connections at once as the proxy serves; before, it carried a quarter of the code's
    descriptors (32), and the rest were reset: 32-64 of 200 such requests went through."""
    network = local.policy(max_requests_per_minute=100_000)
    with Sandbox.create(egress_tier, limits=Limits(timeout_s=120), network=network) as sbx:
        sbx.files.write("burst.py", BURST)
        r = sbx.commands.run(f"python3 burst.py {local.http_port}")
        assert r.stdout.split(" ", 1)[0] == "100", r.stdout + r.stderr


def test_the_codes_descriptor_limit_is_its_own_not_the_relays(egress_tier: str, local: Servers) -> None:
    """The supervisor holds the relay's descriptors besides the code's: every process of the
    code's (a command, run_code's interpreter) still has ``files_per_process``, soft and
    hard, and cannot raise it."""
    limits = Limits()
    each = str(limits.files_per_process)
    with Sandbox.create(egress_tier, network=local.policy()) as sbx:
        assert sbx.commands.run("ulimit -Sn; ulimit -Hn").stdout.split() == [each, each]
        assert sbx.commands.run(f"ulimit -Hn {limits.files_per_process + 1}").exit_code != 0
        got = sbx.run_code("import resource; list(resource.getrlimit(resource.RLIMIT_NOFILE))").text
        assert got == f"[{each}, {each}]"
