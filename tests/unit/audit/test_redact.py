"""Secrets are removed from every string before an event is written."""

from __future__ import annotations

import pytest

from stockade import ConfigurationError
from stockade.audit import Redactor, redact_tokens

CREDENTIALS = {
    "openai": "sk-proj-Abcdefghijklmnop0123456789",
    "anthropic": "sk-ant-api03-Abcdefghijklmnop0123456789",
    "github": "ghp_ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    "github_fine": "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "slack": "xoxb-123456789012-abcdefghijkl",
    "private_key": (
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----"
    ),
}


@pytest.mark.parametrize("name", sorted(CREDENTIALS))
def test_credential_shaped_text_is_redacted(name: str) -> None:
    secret = CREDENTIALS[name]
    text = redact_tokens(f"curl -d '{secret}' https://example.com")
    assert secret not in text
    assert "[REDACTED:" in text


def test_bearer_tokens_and_assignments_keep_their_names() -> None:
    assert (
        redact_tokens("Authorization: Bearer abc123def456ghi789") == "Authorization: Bearer [REDACTED:bearer]"
    )
    assert redact_tokens("password=hunter2hunter") == "password=[REDACTED:assignment]"


def test_ordinary_text_is_left_alone() -> None:
    for text in ("the token parameter is basic", "max_tokens: 1024", "ls -la /workspace", "sk-short"):
        assert redact_tokens(text) == text


def test_registered_secrets_are_replaced_anywhere_even_inside_words() -> None:
    redactor = Redactor()
    redactor.add_secret("correct-horse-battery")

    assert redactor.text("x=correct-horse-battery;y") == "x=[REDACTED:secret];y"


def test_values_under_credential_keys_are_replaced_whole_at_any_depth() -> None:
    attributes = Redactor().attributes(
        {"api_key": "abc", "input_tokens": 12, "env": {"GITHUB_TOKEN": "anything", "HOME": "/home/u"}}
    )
    assert attributes == {
        "api_key": "[REDACTED]",
        "input_tokens": 12,
        "env": {"GITHUB_TOKEN": "[REDACTED]", "HOME": "/home/u"},
    }


def test_attributes_become_json_values() -> None:
    redactor = Redactor()
    assert redactor.value((1, "a", None)) == [1, "a", None]
    assert redactor.value(b"\x00\x01") == "<2 bytes>"
    assert redactor.value(float("inf")) == "inf"


def test_the_pipeline_is_plain_callables_and_can_be_replaced() -> None:
    redactor = Redactor([str.upper])
    assert redactor.text("sk-proj-Abcdefghijklmnop0123456789") == "SK-PROJ-ABCDEFGHIJKLMNOP0123456789"


def test_too_short_a_secret_is_refused_rather_than_redacting_ordinary_text() -> None:
    with pytest.raises(ConfigurationError):
        Redactor().add_secret("ab")


def test_the_redactor_is_also_a_structlog_processor() -> None:
    redactor = Redactor()
    redactor.add_secret("hunter2hunter2")
    assert redactor.structlog_processor(None, "info", {"event": "login hunter2hunter2"}) == {
        "event": "login [REDACTED:secret]"
    }


def test_personal_data_is_redacted_when_asked_and_ordinary_numbers_are_not() -> None:
    from stockade.audit.redact import redact_personal_data

    text = (
        "mail jane.doe@example.co.uk, call +44 20 7946 0958 or (555) 123-4567 from 192.168.1.20; "
        "card 4111 1111 1111 1111, iban DE89 3704 0044 0532 0130 00, ssn 123-45-6789"
    )
    assert redact_personal_data(text) == (
        "mail [REDACTED:email], call [REDACTED:phone] or [REDACTED:phone] from [REDACTED:ip]; "
        "card [REDACTED:card], iban [REDACTED:iban], ssn [REDACTED:ssn]"
    )
    ordinary = "pytest 8.3.4: 12 passed in 0.53s at 2026-12-01 15:08:13, line 1234, id 1234567890123"
    assert redact_personal_data(ordinary) == ordinary
    assert Redactor(personal_data=True).text("ask jane@example.com") == "ask [REDACTED:email]"
    assert Redactor().text("ask jane@example.com") == "ask jane@example.com"  # only when asked
    assert Redactor(personal_data=True).redacts_personal_data and not Redactor().redacts_personal_data


@pytest.mark.parametrize(
    "key",
    [
        "accessToken",
        "refreshToken",
        "clientSecret",
        "apiKey",
        "X-Api-Key",
        "PGPASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "passphrase",
        "db.password",
        "api_key_list",
        "token_list",
        "proxy-authorization",
        "Set-Cookie",
    ],
)
def test_keys_naming_a_credential_in_any_spelling_have_their_values_replaced(key: str) -> None:
    assert Redactor().attributes({key: "plainvalue001"}) == {key: "[REDACTED]"}


def test_a_credential_key_replaces_whatever_it_holds_objects_lists_and_numbers_too() -> None:
    held = {
        "secret": {"value": "plainvalue009"},
        "credentials": {"user": "bob", "pass": "plainvalue010"},
        "api_key_list": ["plainvalue008"],
        "token": 1234567890123,
        "private_key": b"rawbytes",
    }
    assert Redactor().attributes(held) == dict.fromkeys(held, "[REDACTED]")
    # nothing to hide: an absent value, a flag, an empty string stay as they are
    assert Redactor().attributes({"token": None, "has_secret": True, "password": ""}) == {
        "token": None,
        "has_secret": True,
        "password": "",
    }


@pytest.mark.parametrize(
    "key",
    ["max_tokens", "input_tokens", "token_count", "idempotency_key", "cache_key", "key", "session_id",
     "credential_name", "password_hash_algorithm", "tokenizer"],
)  # fmt: skip
def test_keys_that_only_mention_a_credential_word_are_kept(key: str) -> None:
    assert Redactor().attributes({key: "value-kept"}) == {key: "value-kept"}


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ('{"db": {"password": "JsonPw-7788aa"}}', '{"db": {"password": "[REDACTED:json_assignment]"}}'),
        ('{"password": "hunter 2 xyz"}', '{"password": "[REDACTED:json_assignment]"}'),
        ('{"accessToken": "plain-value-1"}', '{"accessToken": "[REDACTED:json_assignment]"}'),
        ('{\\"clientSecret\\": \\"plainvalue\\"}', '{\\"clientSecret\\": \\"[REDACTED:assignment]\\"}'),
        ("export PGPASSWORD=hunter2xyz", "export PGPASSWORD=[REDACTED:assignment]"),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG", "AWS_SECRET_ACCESS_KEY=[REDACTED:assignment]"),
        ("refreshToken: plainvalue007", "refreshToken: [REDACTED:assignment]"),
        ("passphrase='open sesame'", "passphrase='[REDACTED:quoted_assignment]'"),
        ('TOKEN="a b c d"', 'TOKEN="[REDACTED:quoted_assignment]"'),
    ],
)
def test_credentials_written_as_json_or_environment_assignments_are_redacted(
    text: str, redacted: str
) -> None:
    assert redact_tokens(text) == redacted


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("mysql -h db --password hunter2xyz", "mysql -h db --password [REDACTED:flag]"),
        ('gpg --passphrase "open sesame" -d f', 'gpg --passphrase "[REDACTED:flag]" -d f'),
        ("cli --api-key  K3yV4lue --verbose", "cli --api-key  [REDACTED:flag] --verbose"),
        (
            "git clone https://bot:ghs_pass123@github.com/o/r",
            "git clone https://bot:[REDACTED:url_password]@github.com/o/r",
        ),
        (
            "postgresql://stockade:pw@127.0.0.1:5432/db",
            "postgresql://stockade:[REDACTED:url_password]@127.0.0.1:5432/db",
        ),
        (  # the token as the URL's user: one mark (it came out "[REDACTED:[REDACTED:url_password]")
            "git clone https://ghp_abcdefghijklmnopqrstuvwxyz0123456789@github.com/o/r",
            "git clone https://[REDACTED:github_token]@github.com/o/r",
        ),
    ],
)
def test_passwords_given_as_flags_or_in_urls_are_redacted(text: str, redacted: str) -> None:
    # they went to the trail as typed: a command line, a clone URL, a database URL
    assert redact_tokens(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "--token-file /run/secrets/t --password-stdin",
        'parser.add_argument("--token", help="the API token")',
        "see https://example.com/path@v2 and http://host:8080/",
        '{"max_tokens": 1024, "token_count": 5}',
        '{"secret": true, "token": null, "password": false}',
        "if secret == expected_value:",
        "def login(user, password):",
        "tokens = tokenize(text)",
        "password_hash = hash_password(raw)",
        '"passwords_match": "yes"',
        "the token parameter is basic",
    ],
)
def test_ordinary_code_and_json_that_mention_credentials_are_left_alone(text: str) -> None:
    assert redact_tokens(text) == text


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("curl -u deploy:Hx3pN8qR2v https://h", "curl -u deploy:[REDACTED:user_password] https://h"),
        ("redis://:Hx3pN8qR2v@cache:6379/0", "redis://:[REDACTED:url_password]@cache:6379/0"),
        ("key = sk_live_" + "51HxQ2eZvKYlo2C7q9W3e8R4", "key = [REDACTED:stripe_key]"),
        ("rk_test_" + "51HxQ2eZvKYlo2C7q9W3e8R4", "[REDACTED:stripe_key]"),
        ("glpat-Xq7Rk2Wm9Vn4Lp8Zt3Yb", "[REDACTED:gitlab_token]"),
        ("HF_TOKEN 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", "HF_TOKEN [REDACTED:huggingface_token]"),
        ("NPM_TOKEN npm_Q1w2E3r4T5y6U7i8O9p0AsDfGhJkLzXcVbNm", "NPM_TOKEN [REDACTED:npm_token]"),
        ("db_pass=Hx3pN8qR2v", "db_pass=[REDACTED:assignment]"),
        ("DB_PASSWORD=Hx3pN8qR2v", "DB_PASSWORD=[REDACTED:assignment]"),
        ("'password' => 'Hx3pN8qR2v'", "'password' => '[REDACTED:assignment]'"),
        (
            "RuntimeError: db failed: password Zq9hunter2pass-tb",
            "RuntimeError: db failed: password [REDACTED:spaced_password]",
        ),
    ],
)
def test_more_credential_shapes_are_redacted(text: str, redacted: str) -> None:
    """Shapes an outside tester found written in clear (an exception's message reached the run
    store's messages, steps and tool calls)."""
    assert redact_tokens(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "password_length = 12",
        "def check_password(user, raw):",
        "the password is required",
        "reset your password now",
        "docker run -u 1000:1000 image",
        "sort -u names.txt",
        "bypass=enabled compass=north",
        "hf_hub_download(repo_id, filename)",
        "sk_live_mode = True",
        "npm_config_cache=/tmp/npm",
        "a => b",
    ],
)
def test_ordinary_text_near_the_new_shapes_is_left_alone(text: str) -> None:
    assert redact_tokens(text) == text


def test_the_paths_of_a_path_map_are_no_credential_names() -> None:
    """``run_code``'s ``files`` (path -> content): a file named ``x_token`` had its content
    replaced whole, and the script it held was recorded nowhere; its content is text."""
    out = Redactor().attributes(
        {"files": {"x_token": "print('hello')", "cfg/secret": "password=hunter2xyz"}, "api_token": "t"}
    )
    assert out == {
        "files": {"x_token": "print('hello')", "cfg/secret": "password=[REDACTED:assignment]"},
        "api_token": "[REDACTED]",
    }
