"""A here-document's secrets are redacted, and what a shell runs around it is still recorded.

An outside tester wrote a private key, a YAML password and a ``Bearer`` header into files with
``cat <<'EOF'``: any ``<<`` made the command reader fall back to single words, so no pattern of
more than one word (a key block, ``password: x``, ``Bearer x``) matched, and the trail kept
them in clear. A here-document's text is now read as the shell reads it: from the line after
its ``<<``, up to its word; its words hold its values, and a private key in it is read whole.

The same tester found secret shapes no pattern knew: a ``SECRET_KEY=``, an OpenPGP secret key,
an HTTP ``Cookie:`` header and GitHub's ``Authorization: token x``.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade.audit.redact import Redactor, ShellText, redact_tokens

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
    ],
)
def test_more_secret_shapes_are_redacted(text: str, secret: str) -> None:
    for out in (redact_tokens(text), shell(text)):
        assert secret not in out and "[REDACTED:" in out, out


def test_an_openpgp_secret_key_is_redacted_up_to_its_end_line() -> None:
    out = redact_tokens(f"key:\n{PGP_KEY}\nnext")
    assert out == "key:\n[REDACTED:pgp_private_key]\nnext"


def test_what_only_looks_like_those_shapes_is_kept() -> None:
    for text in ("sort_key=name", "cache_key: abcdef", "the token parameter is basic", "Cookie: none"):
        assert redact_tokens(text) == text
    # an armor's header holds no command: ``; rm`` ends the key
    assert "; rm -rf src" in redact_tokens("-----BEGIN PGP PRIVATE KEY BLOCK-----\nComment: x; rm -rf src\n")
