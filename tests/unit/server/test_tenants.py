"""Tenants and API tokens (``stockade.server.tenants``): every bad token is the same
``AuthenticationError`` by the same path (one SHA-256, one constant-time comparison of two
digests), and a tenants file that is wrong says where."""

from __future__ import annotations

import hashlib
import hmac
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from stockade import exceptions as exc
from stockade.policy.schema import Policy, Role
from stockade.server.tenants import (
    Quotas,
    Tenant,
    Tenants,
    TenantsFile,
    TokenRecord,
    check_weaker,
    new_token,
    parse_token,
)


def tenants_with(*records: TokenRecord) -> Tenants:
    policy = Policy(roles={"dev": Role(tiers=("process",)), "viewer": Role(tools=("read_file",))})
    return Tenants(
        tenants={"acme": Tenant(id="acme", policy=policy), "other": Tenant(id="other")},
        tokens={r.id: r for r in records},
    )


@pytest.fixture
def issued() -> tuple[Tenants, str, str]:
    acme, acme_record = new_token("acme", "dev")
    other, other_record = new_token("other")
    return tenants_with(acme_record, other_record), acme, other


def test_a_token_names_its_tenant_and_role(issued: tuple[Tenants, str, str]) -> None:
    tenants, acme, other = issued
    principal = tenants.authenticate(acme)
    assert principal.tenant.id == "acme" and principal.role == "dev"
    assert acme.startswith(f"stk_{principal.token_id}_")
    assert tenants.authenticate(other).tenant.id == "other"


def test_the_record_keeps_only_the_secrets_digest() -> None:
    token, record = new_token("acme", "dev")
    token_id, secret = parse_token(token) or ("", "")
    assert record.id == token_id and secret not in repr(record)
    assert record.sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert new_token("acme")[0] != new_token("acme")[0]


def bad_tokens(good: str) -> dict[str, str]:
    token_id, secret = parse_token(good) or ("", "")
    return {
        "wrong secret": f"stk_{token_id}_{'A' * len(secret)}",
        "secret one character off": f"stk_{token_id}_{secret[:-1]}{'B' if secret[-1] != 'B' else 'C'}",
        "unknown id": f"stk_000000000000_{secret}",
        "malformed": "not-a-token",
        "empty": "",
        "id only": f"stk_{token_id}_",
        "uppercase id": f"stk_{token_id.upper()}_{secret}",
        "very long": "stk_" + "x" * 100_000,
    }


def test_every_bad_token_is_the_same_authentication_error(issued: tuple[Tenants, str, str]) -> None:
    tenants, acme, other = issued
    other_id = (parse_token(other) or ("", ""))[0]
    swapped = f"stk_{other_id}_{(parse_token(acme) or ('', ''))[1]}"  # the other tenant's id, this secret
    cases = {**bad_tokens(acme), "swapped": swapped}
    messages = set()
    for why, token in cases.items():
        with pytest.raises(exc.AuthenticationError) as refused:
            tenants.authenticate(token)
        assert not refused.value.retryable, why
        messages.add(str(refused.value))
    assert len(messages) == 1  # nothing in the answer says which part was wrong
    assert "stockade token new" in messages.pop()


def work_done(call: Callable[[], object]) -> list[tuple[str, int]]:
    """What ``call`` computes of the secret: each SHA-256 of it (``_digest``) and each
    ``hmac.compare_digest``, with the length of the digest it compares against. Watched with
    the interpreter's profiler: nothing of ours is replaced."""
    seen: list[tuple[str, int]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "_digest":
            seen.append(("sha256", 0))
        elif event == "c_call" and arg is hmac.compare_digest:
            seen.append(("compare_digest", len(frame.f_locals.get("expected", ""))))

    sys.setprofile(profile)
    try:
        call()
    except exc.AuthenticationError:
        pass
    finally:
        sys.setprofile(None)
    return seen


def test_a_bad_token_costs_what_a_good_one_does(issued: tuple[Tenants, str, str]) -> None:
    tenants, acme, _ = issued
    good = work_done(lambda: tenants.authenticate(acme))
    assert good == [("sha256", 0), ("compare_digest", 64)]
    for why, token in bad_tokens(acme).items():
        # an unknown id or a malformed token is compared with a dummy digest of the same length:
        # the answer takes as long whatever is wrong with the token
        assert work_done(lambda token=token: tenants.authenticate(token)) == good, why  # type: ignore[misc]


def test_tenant_ids_and_token_records_are_checked_together() -> None:
    with pytest.raises(exc.InvalidArgument) as bad_id:
        Tenants(tenants={"Acme-Corp": Tenant(id="Acme-Corp")}, tokens={})
    assert bad_id.value.argument == "tenants" and "lowercase" in bad_id.value.fix
    _, stray = new_token("nobody")
    with pytest.raises(exc.InvalidArgument) as unknown:
        tenants_with(stray)
    assert unknown.value.argument == "tokens.tenant" and "acme" in unknown.value.fix
    _, roleless = new_token("acme", "admin")
    with pytest.raises(exc.InvalidArgument) as role:
        tenants_with(roleless)
    assert role.value.argument == "tokens.role" and "dev" in role.value.fix
    _, no_role = new_token("acme")  # a policy with roles needs one named
    with pytest.raises(exc.InvalidArgument):
        tenants_with(no_role)


def write(folder: Path, text: str) -> Path:
    path = folder / "tenants.toml"
    path.write_text(text)
    return path


def test_a_tenants_file_loads_with_its_policy_quotas_and_tokens(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(
        'version = 1\n[trust]\nlevel = "internal"\n[roles.dev]\ntiers = ["docker"]\n'
    )
    token, record = new_token("acme", "dev")
    text = (
        '[tenants.acme]\npolicy = "p.toml"\nsandboxes = 2\ncpus = 1.5\nmemory_mb = 1024\nruns = 7\n'
        "output_bytes = 4096\nrate_per_minute = 60\ndollars_per_hour = 2.5\n\n"
        + Tenants(tenants={}, tokens={}).toml_lines(record)
    )
    tenants = Tenants.load(write(tmp_path, text))
    acme = tenants.tenants["acme"]
    assert acme.quotas == Quotas(sandboxes=2, cpus=1.5, memory_mb=1024, runs=7, output_bytes=4096)
    assert acme.rate_per_minute == 60 and acme.dollars_per_hour == 2.5
    assert acme.policy.trust.level.value == "internal" and acme.audit_namespace == "audit_t_acme"
    assert tenants.authenticate(token).role == "dev"


@pytest.mark.parametrize(
    ("text", "error", "words"),
    [
        ("[tenants.acme\n", exc.ConfigurationError, "not valid TOML"),
        ("[tenants.acme]\ncolour = 'red'\n", exc.PolicyFileError, "tenants.acme.colour"),
        ("[tenants.acme]\nsandboxes = -1\n", exc.PolicyFileError, "tenants.acme.sandboxes"),
        ("[tenants.acme]\nrate_per_minute = 0\n", exc.PolicyFileError, "rate_per_minute"),
        ("[tenants.acme]\noutput_bytes = 0\n", exc.PolicyFileError, "tenants.acme.output_bytes"),
        ("[[tokens]]\nid = 'xyz'\nsha256 = 'ab'\ntenant = 'acme'\n", exc.PolicyFileError, "tokens.0.id"),
        # inf passed the lower bounds: the tenant's rate-limited requests were answered 500
        ("[tenants.acme]\nrate_period_s = inf\n", exc.PolicyFileError, "tenants.acme.rate_period_s"),
        ("[tenants.acme]\ndollars_per_hour = inf\n", exc.PolicyFileError, "dollars_per_hour"),
        ("[tenants.acme]\nkeep_runs_days = inf\n", exc.PolicyFileError, "keep_runs_days"),
        ("[tenants.acme]\ncpus = nan\n", exc.PolicyFileError, "tenants.acme.cpus"),
    ],
)
def test_a_wrong_tenants_file_says_where(
    tmp_path: Path, text: str, error: type[exc.StockadeError], words: str
) -> None:
    with pytest.raises(error) as raised:
        Tenants.load(write(tmp_path, text))
    assert words in str(raised.value) + " ".join(getattr(raised.value, "problems", ()))


def test_only_the_tenants_file_lets_a_tenant_accept_weaker_enforcement(tmp_path: Path) -> None:
    """Off unless the operator writes ``allow_weaker = true`` for the tenant; a word that only
    looks like a yes is refused, not taken for one."""
    text = "[tenants.acme]\nallow_weaker = true\n[tenants.other]\n"
    tenants = Tenants.load(write(tmp_path, text))
    assert tenants.tenants["acme"].allow_weaker and not tenants.tenants["other"].allow_weaker
    for word in ('"yes"', '"false"', "1"):
        with pytest.raises(exc.PolicyFileError) as refused:
            Tenants.load(write(tmp_path, f"[tenants.acme]\nallow_weaker = {word}\n"))
        assert "tenants.acme.allow_weaker" in " ".join(refused.value.problems), word


def test_a_weaker_sandbox_needs_the_operators_consent_and_says_where_to_give_it() -> None:
    weakened = ("ptys: bounded only by the host's kernel.pty.max, shared (no root)",)
    check_weaker(Tenant(id="acme", allow_weaker=True), weakened, what="this sandbox")
    check_weaker(Tenant(id="acme"), (), what="this sandbox")  # nothing weaker: the request's consent is moot
    with pytest.raises(exc.PolicyDenied) as refused:
        check_weaker(Tenant(id="acme"), weakened, what="this sandbox")
    assert refused.value.rule == "tenants.acme.allow_weaker"
    assert "allow_weaker = true under [tenants.acme]" in str(refused.value) and "kernel.pty.max" in str(
        refused.value
    )


def test_a_missing_tenants_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(exc.ConfigurationError, match="cannot read"):
        Tenants.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"[tenants.acme]\nname = '\xff'\n", "not UTF-8"), (b"x = " + b"[" * 5000 + b"\n", "nests too deeply")],
    ids=["not-utf8", "deep"],
)
def test_a_tenants_file_that_cannot_be_parsed_is_a_configuration_error(
    tmp_path: Path, content: bytes, words: str
) -> None:
    """Both escaped untyped (UnicodeDecodeError, RecursionError) and ended `stockade serve`
    with a traceback."""
    path = tmp_path / "tenants.toml"
    path.write_bytes(content)
    with pytest.raises(exc.ConfigurationError, match=words):
        Tenants.load(path)


# -- a followed tenants file (``TenantsFile``) -----------------------------------------------------


def followed_text(*records: TokenRecord, sandboxes: int = 2) -> str:
    lines = "".join(Tenants(tenants={}, tokens={}).toml_lines(r) for r in records)
    return f'[tenants.acme]\npolicy = "p.toml"\nsandboxes = {sandboxes}\n\n[tenants.other]\n\n{lines}'


def policy_with(tmp_path: Path, level: str) -> None:
    (tmp_path / "p.toml").write_text(f'version = 1\n[trust]\nlevel = "{level}"\n[roles.dev]\n')


def test_a_followed_tenants_file_is_loaded_again_when_it_changes(tmp_path: Path) -> None:
    policy_with(tmp_path, "internal")
    acme, acme_record = new_token("acme", "dev")
    other, other_record = new_token("other")
    followed = TenantsFile(write(tmp_path, followed_text(acme_record, other_record)), check_s=0)
    assert followed.current().authenticate(other).tenant.id == "other"

    write(tmp_path, followed_text(acme_record, sandboxes=5))  # other's token out, acme's quota up
    now = followed.current()
    with pytest.raises(exc.AuthenticationError):
        now.authenticate(other)
    assert now.authenticate(acme).tenant.quotas.sandboxes == 5
    assert followed.current() is now  # unchanged: not read again


def test_a_followed_file_is_looked_at_once_per_period_and_at_once_when_asked(tmp_path: Path) -> None:
    """``reload_soon`` (SIGHUP): a policy file the tenants file names changed, which changes
    nothing the file's identity shows."""
    policy_with(tmp_path, "internal")
    acme, acme_record = new_token("acme", "dev")
    other, other_record = new_token("other")
    followed = TenantsFile(write(tmp_path, followed_text(acme_record, other_record)), check_s=3600)
    write(tmp_path, followed_text(acme_record))
    policy_with(tmp_path, "trusted")
    assert followed.current().authenticate(other).tenant.id == "other"  # not looked at yet

    followed.reload_soon()
    now = followed.current()
    with pytest.raises(exc.AuthenticationError):
        now.authenticate(other)
    assert now.authenticate(acme).tenant.policy.trust.level.value == "trusted"


def test_a_followed_file_that_no_longer_loads_keeps_its_last_table_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy_with(tmp_path, "internal")
    _, acme_record = new_token("acme", "dev")
    other, other_record = new_token("other")
    path = write(tmp_path, followed_text(acme_record))
    followed = TenantsFile(path, check_s=0)
    table = followed.current()
    fixed = followed_text(acme_record, other_record)
    # a broken edit that would let "other" in, a role its policy lacks, a file emptied (as one
    # being written in place may be for a moment), the file gone
    for broken in (fixed + "[tenants.acme\n", fixed.replace('role = "dev"', 'role = "ops"'), "", None):
        caplog.clear()
        if broken is None:
            path.unlink()
        else:
            write(tmp_path, broken)
        with caplog.at_level(logging.ERROR, logger="stockade.server"):
            assert followed.current() is table and followed.current() is table
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "keeps its last table (2 tenants, 1 tokens)" in errors[0].getMessage()
        with pytest.raises(exc.AuthenticationError):
            followed.current().authenticate(other)

    write(tmp_path, fixed)
    assert followed.current().authenticate(other).tenant.id == "other"


def test_a_followed_file_must_load_when_it_is_first_read(tmp_path: Path) -> None:
    with pytest.raises(exc.ConfigurationError, match="not valid TOML"):
        TenantsFile(write(tmp_path, "[tenants.acme\n"))


def test_a_rewrite_within_the_same_clock_tick_is_not_missed(tmp_path: Path) -> None:
    """The same size, written again at once: the file's times may not have moved (they tick
    coarsely), so a file changed this recently is read again at the next check."""
    policy_with(tmp_path, "internal")
    first, first_record = new_token("acme", "dev")
    second, second_record = new_token("acme", "dev")
    followed = TenantsFile(write(tmp_path, followed_text(first_record)), check_s=0)
    write(tmp_path, followed_text(second_record))  # as long, in place: maybe the same identity
    assert followed.current().authenticate(second).tenant.id == "acme"
    with pytest.raises(exc.AuthenticationError):
        followed.current().authenticate(first)
