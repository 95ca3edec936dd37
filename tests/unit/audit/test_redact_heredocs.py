"""A here-document's secrets are redacted, and what a shell runs around it is still recorded.

An outside tester wrote a private key, a YAML password and a ``Bearer`` header into files with
``cat <<'EOF'``: any ``<<`` made the command reader fall back to single words, so no pattern of
more than one word (a key block, ``password: x``, ``Bearer x``) matched, and the trail kept
them in clear. A here-document's text is now read as the shell reads it: from the line after
its ``<<``, up to its word; its words hold its values, and a private key in it is read whole.

The same tester found secret shapes no pattern knew: a ``SECRET_KEY=``, an OpenPGP secret key,
an HTTP ``Cookie:`` header and GitHub's ``Authorization: token x``.

And then more: ``OPENAI_KEY=``, openssl's ``-passin pass:x``, a header's second cookie and curl's
``-b``, a Digest's ``response``, a signed URL's ``sig=``, ``aws configure set``'s value, a YAML
value on the next line, ``--user=u:x``, XML's ``<password>``, ``passwords=``, and a value the
shell joins from quoted parts (``PASSWORD=""x``) were kept in clear; ``python3 -u a:b`` was
redacted as curl's user and password.
"""

from __future__ import annotations

import re
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.audit.redact import (
    TAIL_PATTERNS,
    TOKEN_PATTERNS,
    Redactor,
    ShellText,
    flag_value,
    redact_tokens,
)

KEY_BODY = (
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACDkSECRETKEYBODY2"
)
KEY = f"-----BEGIN OPENSSH PRIVATE KEY-----\n{KEY_BODY}\n-----END OPENSSH PRIVATE KEY-----"
PGP_KEY = (
    "-----BEGIN PGP PRIVATE KEY BLOCK-----\nVersion: GnuPG v2\n\n"
    "lQOYBGZx1aABCADQ2Vm3Xk7Vn2Bc5Lp9Rt4Yh6Gj1Df0Sa8Wm3Xk7Vn2Bc5Lp9Rt4\nPGPSECRETBODY2x\n=Zq8W\n"
    "-----END PGP PRIVATE KEY BLOCK-----"
)


def shell(text: str) -> str:
    return Redactor().text(ShellText(text))


@pytest.mark.parametrize(
    ("command", "secret"),
    [
        (f"cat > id_ed25519 <<'EOF'\n{KEY}\nEOF\nchmod 600 id_ed25519", "SECRETKEYBODY"),
        (f"cat > id_ed25519 <<EOF\n{KEY}\nEOF", "SECRETKEYBODY"),
        (f"cat > k.asc <<'EOF'\n{PGP_KEY}\nEOF", "PGPSECRETBODY"),
        ("cat > config.yaml <<EOF\ndb:\n  password: hunter2xyzSECRET\nEOF", "hunter2xyzSECRET"),
        ("cat > .env <<EOF\nSECRET_KEY=djangoSECRETvalue123\nEOF", "djangoSECRETvalue123"),
        (
            "python3 - <<EOF\nprint({'Authorization': 'Bearer abcdefghij12SECRET'})\nEOF",
            "abcdefghij12SECRET",
        ),
        ('python3 - <<"EOF"\nPASSWORD = "pySECRETvalue99"\nEOF', "pySECRETvalue99"),
        ("cat <<-EOF > c.ini\n\tpassword = iniSECRETvalue99\n\tEOF", "iniSECRETvalue99"),
        ("cat > h.txt <<EOF\nCookie: session=cookieSECRET99\nEOF", "cookieSECRET99"),
        ("cat <<A <<B\nx\nA\ntoken: firstDOCSECRET9\nB", "firstDOCSECRET9"),
        ("X=$(cat <<EOF\npassword: nestedSECRET99\nEOF\n)", "nestedSECRET99"),
        ("cat <<EOF\nTOKEN=x $(login --token Zq9hunter2x)\nEOF", "Zq9hunter2x"),
    ],
)
def test_a_secret_in_a_here_document_is_redacted(command: str, secret: str) -> None:
    out = shell(command)
    assert secret not in out and "[REDACTED:" in out, out


@pytest.mark.parametrize(
    ("command", "kept"),
    [
        (f"cat > k <<'EOF'\n{KEY}\nEOF\nchmod 600 k; rm -rf src", "EOF\nchmod 600 k; rm -rf src"),
        ('sh <<\'EOF\'\nV="--password "; rm -rf src; echo "done"\nEOF', "rm -rf src"),
        ('cat <<-X | sh\n\tV="--password "; rm -rf src; echo "done"\n\tX', "rm -rf src"),
        (
            "python3 - <<EOF\nP = '--password '; os.system('rm -rf src'); Q = 'x'\nEOF",
            "os.system('rm -rf src')",
        ),
        ('cat <<EOF\nX="PASSWORD="ab rm -rf src""\nEOF', "rm -rf src"),
        ("cat <<EOF\npassword: x\nEOF\npassword=abcd;rm -rf src", ";rm -rf src"),
        ("cat <<EOF\nEOF-not-the-end\nEOF\nrm -rf src", "\nrm -rf src"),
        ("gh auth login --with-token <<< ghp_abcdefghijklmnopqrstuvwxyz0123; rm -rf src", "; rm -rf src"),
    ],
)
def test_what_a_shell_runs_around_a_here_document_is_recorded(command: str, kept: str) -> None:
    assert kept in shell(command)


@pytest.mark.parametrize(
    "command",
    [
        "cat <<EOF\nonly the head of a document, no end",
        "cat <<EOF\nline one \\\nEOF\npassword: x",  # a line joined to the next: the shells differ
        "cat <<$(echo EOF)\nx\nEOF",
        "X=$(cat <<EOF\nx\n)\nEOF",
        "cat <<'EOF\nx",
        "cat <<",
        "sh" + " <<A\n" * 50,  # documents in documents, past the reader's depth
    ],
)
def test_an_unusual_here_document_is_read_without_failing(command: str) -> None:
    assert shell(command + "\ntrue --token abcd;rm -rf src").endswith(";rm -rf src")


# A text whose words a value may end in, and what then runs a command.
OPENERS = ["--password ", 'V="--password "', "PASSWORD=", "password: ", "Bearer ", "X-Api-Key: ", "'token':"]
SEPARATORS = [";", " ; ", "&&", "|", "\n", "$(", "`"]


@settings(max_examples=200, deadline=None)
@given(
    opener=st.sampled_from(OPENERS),
    value=st.text(alphabet=string.ascii_letters + string.digits + "-_=+/.:'\" ", max_size=12),
    separator=st.sampled_from(SEPARATORS),
    delimiter=st.sampled_from(["EOF", "'EOF'", '"EOF"', "-EOF"]),
)
def test_a_command_in_a_here_document_fed_to_a_shell_is_always_recorded(
    opener: str, value: str, separator: str, delimiter: str
) -> None:
    """``sh <<EOF``: the document is a script; whatever its first line is shaped like, the
    shell runs ``echo MARKER > f`` here, and the trail shows it."""
    command = f"sh <<{delimiter}\n{opener}{value}{separator}echo MARKER > f\nEOF\necho after"
    out = shell(command)
    assert "echo MARKER > f" in out and out.endswith("\necho after"), command


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("SECRET_KEY=django-insecure-abcdef", "django-insecure-abcdef"),
        ("export PRIVATE_KEY=abcdefgh123", "abcdefgh123"),
        ('ENCRYPTION_KEY="a b c d"', "a b c d"),
        ("--signing-key Zq9hunter2x", "Zq9hunter2x"),
        ("Cookie: session=abcdef123456789; theme=dark", "abcdef123456789"),
        ("curl -H 'Cookie: sid=abcdef123456789' https://h", "abcdef123456789"),
        ("Authorization: token ghx0123456789abcdef", "ghx0123456789abcdef"),
        ("STRIPE_SECRET_KEY=stripeSECRET99", "stripeSECRET99"),
        ("OPENAI_KEY=openaiSECRET99", "openaiSECRET99"),
        ("export AZURE_OPENAI_KEY=azureSECRET99", "azureSECRET99"),
        ("passwords=listSECRET99", "listSECRET99"),
        ("openssl rsa -in k.pem -passin pass:sslSECRET99 -out k2.pem", "sslSECRET99"),
        ("openssl enc -aes256 -pass 'pass:sslSECRET99' -in f", "sslSECRET99"),
        ("openssl req -passout pass:sslSECRET99", "sslSECRET99"),
        ("curl -H 'Cookie: theme=dark; session=secondCOOKIE99' https://h", "secondCOOKIE99"),
        ("curl -b 'session=flagCOOKIE99' https://h", "flagCOOKIE99"),
        ("curl --cookie sid=flagCOOKIE99 https://h", "flagCOOKIE99"),
        (
            'curl -H \'Authorization: Digest username="u", realm="r", nonce="n", uri="/", '
            'response="6629fae49393a05397450978507c4ef1"\' https://h',
            "6629fae49393a05397450978507c4ef1",
        ),
        (
            "curl 'https://a.blob.core.windows.net/c/b?sv=2022-11-02&sig=sasSIGNATURE99%3D&se=1'",
            "sasSIGNATURE99",
        ),
        (
            "wget 'https://b.s3.amazonaws.com/k?X-Amz-Date=1&X-Amz-Signature=4f9a0b1c2d3e4f50617'",
            "4f9a0b1c2d3e4f50617",
        ),
        ("https://storage.googleapis.com/b/k?X-Goog-Signature=9f8e7d6c5b4a3921", "9f8e7d6c5b4a3921"),
        ("aws configure set aws_secret_access_key awsSECRET99 --profile p", "awsSECRET99"),
        ("curl --user=admin:userSECRET99 https://h", "userSECRET99"),
        ("curl -uadmin:userSECRET99 https://h", "userSECRET99"),
        ("echo '<password>xmlSECRET99</password>'", "xmlSECRET99"),
        ("echo '<SecretAccessKey>xml/SECRET&amp;99</SecretAccessKey>'", "xml/SECRET&amp;99"),
        ("echo '<token>xmlSECRET99</token>'", "xmlSECRET99"),
    ],
)
def test_more_secret_shapes_are_redacted(text: str, secret: str) -> None:
    for out in (redact_tokens(text), shell(text)):
        assert secret not in out and "[REDACTED:" in out, out


def test_an_openpgp_secret_key_is_redacted_up_to_its_end_line() -> None:
    out = redact_tokens(f"key:\n{PGP_KEY}\nnext")
    assert out == "key:\n[REDACTED:pgp_private_key]\nnext"


def test_what_only_looks_like_those_shapes_is_kept() -> None:
    for text in (
        "sort_key=name",
        "cache_key: abcdef",
        "primary_key=user_id",
        "public_key=ssh-ed25519",
        "the token parameter is basic",
        "Cookie: none",
        "openssl rsa -passin env:KEY_PASSPHRASE -passout file:/run/pass.txt",
        "http status response=200",
        "password:\n  user: admin",  # a mapping under the name, not its value
        "password:\n  - first",
        "<password></password>",
        "git checkout -b feature",
    ):
        assert redact_tokens(text) == text
        assert shell(text) == text
    # an armor's header holds no command: ``; rm`` ends the key
    assert "; rm -rf src" in redact_tokens("-----BEGIN PGP PRIVATE KEY BLOCK-----\nComment: x; rm -rf src\n")


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("db:\n  password:\n    yamlSECRET99\n  user: app", "yamlSECRET99"),
        ("token: |\n  yamlSECRET99\nnext: 1", "yamlSECRET99"),
        ("api_key: >\n    yamlSECRET99", "yamlSECRET99"),
    ],
)
def test_a_yaml_value_on_the_next_line_is_redacted(text: str, secret: str) -> None:
    for out in (redact_tokens(text), shell(f"cat > c.yaml <<EOF\n{text}\nEOF")):
        assert secret not in out and "[REDACTED:" in out, out
    assert "user: app" in redact_tokens(text) or "user" not in text


@pytest.mark.parametrize(
    ("command", "recorded"),
    [
        ('PASSWORD=""hunter2xyz', 'PASSWORD=""[REDACTED:assignment]'),
        ("PASSWORD=hun''ter2xyz && ls", "PASSWORD=[REDACTED:assignment] && ls"),
        ("PASSWORD=\"hun\"'ter2xyz' ls", "PASSWORD=[REDACTED:assignment] ls"),
        ('PASSWORD=hunter2"xyz"', "PASSWORD=[REDACTED:assignment]"),
        ("PASSWORD=$'hunter2xyz'; rm -rf src", "PASSWORD=$'[REDACTED:assignment]'; rm -rf src"),
        ("mysql --password \"hun\"'ter2xyz' db", "mysql --password [REDACTED:flag] db"),
        ('echo \'{"password":"abcd1234"}\'', 'echo \'{"password":"[REDACTED:json_assignment]"}\''),
    ],
)
def test_a_word_is_redacted_as_the_shell_joins_its_quoted_parts(command: str, recorded: str) -> None:
    """The shell joins ``""``, ``'...'`` and ``"..."`` parts into one word: a value in parts
    is one value, replaced whole; the quotes around what is kept stay."""
    assert shell(command) == recorded


@pytest.mark.parametrize(
    ("command", "recorded"),
    [
        ("python3 -u run:exfiltrate.py", "python3 -u run:exfiltrate.py"),
        ("sort -u a:/etc/shadow; cp -b k=v d", "sort -u a:/etc/shadow; cp -b k=v d"),
        (
            "FOO=1 sudo -E /usr/bin/curl -u deploy:hunter2 h && python3 -u a:b.py",
            "FOO=1 sudo -E /usr/bin/curl -u deploy:[REDACTED:user_password] h && python3 -u a:b.py",
        ),
        ("X=$(curl -s -b s=cookie1234 h)", "X=$(curl -s -b s=[REDACTED:cookie] h)"),
    ],
)
def test_curl_s_user_and_cookie_flags_take_the_next_word_in_curl_s_command_only(
    command: str, recorded: str
) -> None:
    assert shell(command) == recorded


def test_an_argv_s_flag_value_is_known_by_its_program() -> None:
    assert flag_value(["python3", "-u", "run:exfiltrate.py"], 2) is None
    assert flag_value(["curl", "-u", "deploy:hunter2"], 2) == "deploy:[REDACTED:user_password]"
    assert flag_value(["curl", "-b", "sid=abcdef12"], 2) == "sid=[REDACTED:cookie]"
    assert flag_value(["curl", "-b", "cookies.txt"], 2) is None
    assert flag_value(["openssl", "rsa", "-passin", "pass:hunter2"], 3) == "pass:[REDACTED:openssl_pass]"
    assert flag_value(["openssl", "rsa", "-passin", "env:PASS"], 3) is None
    assert flag_value(["aws", "configure", "set", "aws_secret_access_key", "x1234"], 4) == "[REDACTED:flag]"


NEW_SHAPES = [
    "cookie",
    "digest_response",
    "url_signature",
    "xml_element",
    "openssl_pass",
    "aws_configure",
    "yaml_next_line",
    "user_password",
]
# 16 KB texts built to make a pattern of those shapes try again and again
ADVERSARIAL = [
    "Cookie: a=" + "b=" * 8000,
    "Cookie: a=b" + "; c=d" * 3000,
    "-b " + "a=" * 8000,
    "response=" + "a" * 16000,
    "&sig=" + "&sig=a" * 3000,
    "<password>" + "a" * 16000,
    "<password>" * 1600,
    "<password>a" * 1500,
    "<" + "password" * 2000 + ">",
    "<a" * 8000,
    "-passin pass:" + "a" * 16000,
    "-passin 'pass:" + "a" * 16000,
    "aws_secret_access_key " * 700,
    "password:\n  " + "a" * 16000,
    "password: |\n " * 1300,
    "a." * 8000,
    "-u" + "a" * 16000,
    "-ua" * 5400,
    "--user=" + "a:" * 8000,
]


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_a_new_shape_reads_a_long_text_in_linear_time(name: str) -> None:
    patterns = (re.compile(TOKEN_PATTERNS[name]), re.compile(TAIL_PATTERNS[name]))
    for text in ADVERSARIAL:
        started = time.thread_time()  # this thread's CPU: a loaded host does not stretch it
        patterns[0].sub("", text)
        patterns[1].search(text)
        assert time.thread_time() - started < 0.1, (name, text[:20])


def test_a_long_command_of_quoted_words_is_read_in_linear_time() -> None:
    for command in ("PASSWORD=\"a\"'b'" * 1000, "curl -u a:b " * 1300, "x=$'a'" * 2600):
        started = time.thread_time()
        shell(command)
        assert time.thread_time() - started < 0.5, command[:20]
