"""A text cut before it was redacted keeps no head of a secret or of a credential at the cut.

A sandbox caps each word of an exec it reports, a proxy shortens a long path: the redactor then
sees half a token, which no pattern matches and no registered value equals. ``Redactor.head``
holds back whatever at the end may have begun one.
"""

from __future__ import annotations

import re
import string

from hypothesis import given, settings
from hypothesis import strategies as st

from stockade._cuts import CUT_MARK, cut_marker
from stockade._state import CARRIED, STATE_DIR, is_state
from stockade.audit.redact import CUT_REDACTED, TOKEN_PATTERNS, Redactor
from stockade.audit.sandbox_texts import exec_word
from stockade.tools.observations import OUTPUT_DIR, clip
from stockade.tools.testrun import REPORT_DIR
from stockade.tools.workspace_diff import BASELINE

# (what comes before the value, the value): a credential of each pattern's shape, cut in its value
CREDENTIALS = {
    "api_key": ("sk-proj-", "Q1w2E3r4T5y6U7i8O9p0AsDfGhJkLzXc"),
    "github_token": ("ghp_", "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa"),
    "aws_access_key": ("AKIA", "Q7W3E9R2T5Y8U1I4"),
    "slack_token": ("xoxb-", "9876543210-AbCdEfGhIjKl"),
    "google_api_key": ("AIza", "SyQ1w2E3r4T5y6U7i8O9p0AsDfGhJkLzXcV"),
    "stripe_key": ("sk_live_", "51HxQ2eZvKYlo2C7q9W3e8R4t6Y1u5I0"),
    "gitlab_token": ("glpat-", "Xq7Rk2Wm9Vn4Lp8Zt3Yb"),
    "huggingface_token": ("hf_", "QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi"),
    "npm_token": ("npm_", "Q1w2E3r4T5y6U7i8O9p0AsDfGhJkLzXcVbNm"),
    "jwt": ("eyJ", "hbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.Sfl2KxwRJSMeKKF2QT4fwpM"),
    "bearer": ("Authorization: Bearer ", "Zq8Wm3Xk7Vn2Bc5Lp9Rt4Yh6Gj1Df0Sa"),
    "cookie": ("Cookie: session=", "Vb3Nq8Lx2Wk5Rt7Hz1; theme=Qx7Lm2Zr9"),
    "digest_response": ('Authorization: Digest username="u", response="', "6629fae49393a05397450978507c4ef1"),
    "url_signature": ("https://a.blob.core.windows.net/c?sv=2022&sig=", "Hq7Zx2Lm9%2BWk4Rt8Vn3"),
    "xml_element": ("<SecretAccessKey>", "wJalrXUtnFEMI/K7MDENG&amp;bPxRfiCY"),
    "openssl_pass": ("openssl rsa -passin pass:", "Mz4Kq8Wn2Lx6"),
    "aws_configure": ("aws configure set aws_secret_access_key ", "Rk2Vb7Nq4Zx9"),
    "yaml_next_line": ("password: |\n  ", "Lq3Wz8Kx5Mv1"),
    "json_assignment": ('{"password": "', "Kw7 open sesame Qx2"),
    "quoted_assignment": ("passphrase='", "Mv4 open sesame Pz8"),
    "url_password": ("https://deploy:", "Hx3pN8qR2vL6"),
    "flag": ("mysql --password ", "Tq5Wz9Lm2Rk7"),
    "user_password": ("curl -u deploy:", "Jv8Hs3Qw6Np1"),
    "spaced_password": ("db failed: password ", "Zq9hunter2Kx7"),
    "assignment": ("PGPASSWORD=", "Yb6Nc1Vx8Zm3"),
}


def test_every_token_pattern_has_a_sample() -> None:
    keys = {"private_key", "pgp_private_key"}  # a key's body is redacted to the end
    assert set(CREDENTIALS) == set(TOKEN_PATTERNS) - keys


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(sorted(CREDENTIALS)),
    before=st.text(alphabet=string.ascii_letters + string.digits + " .,;/", max_size=40),
    cut=st.integers(min_value=0),
)
def test_no_head_of_a_credential_survives_a_cut(kind: str, before: str, cut: int) -> None:
    prefix, value = CREDENTIALS[kind]
    at = cut % (len(value) + 1)
    out = Redactor().head(f"{before} {prefix}{value[:at]}")
    kept = value[:at]
    for start in range(len(kept) - 3):
        assert kept[start : start + 4] not in out.replace(before, ""), (kind, out)


@settings(max_examples=400, deadline=None)
@given(
    secret=st.text(alphabet=string.ascii_letters + string.digits + "-_!@#", min_size=8, max_size=60),
    before=st.text(alphabet=" .,;:", max_size=30),
    cut=st.integers(min_value=0),
)
def test_no_head_of_a_registered_secret_survives_a_cut(secret: str, before: str, cut: int) -> None:
    redactor = Redactor()
    redactor.add_secret(secret)
    at = cut % len(secret)
    out = redactor.head(before + secret[:at])
    if at >= 4:
        assert secret[:4] not in out, out


def test_what_is_not_a_credential_is_kept_whole() -> None:
    redactor = Redactor()
    redactor.add_secret("open-sesame-42")
    assert redactor.head("pytest -q tests/unit --maxfail=3") == "pytest -q tests/unit --maxfail=3"
    assert redactor.head("echo " + "B" * 100) == "echo " + "B" * 100
    # the token whole is redacted as always; only the end of the text is looked at again
    assert redactor.head("ghp_" + "C" * 36 + " and more") == "[REDACTED:github_token] and more"
    assert redactor.head("say open-ses") == "say " + CUT_REDACTED


def test_a_secret_shaped_like_a_credential_is_held_back_from_its_start() -> None:
    """The tail pattern starts inside the secret; what is left ends with the secret's head."""
    redactor = Redactor()
    redactor.add_secret("deploy-password=Xy7Kq2")
    assert redactor.head("run deploy-password=Xy7") == "run " + CUT_REDACTED


def test_a_word_the_sandbox_cut_keeps_its_mark_and_no_head() -> None:
    """What the sandbox reports of an over-long exec word (``supervisor.execrecords.kept_argv``)."""
    mark = "[... 17 more characters; the word is sha256 " + "ab" * 32 + "]"
    word = "B" * 4072 + " ghp_" + "C" * 19 + mark
    out = exec_word(Redactor(), word)
    assert out.endswith(" " + CUT_REDACTED + mark) and "CCCC" not in out
    assert exec_word(Redactor(), "ghp_" + "C" * 19) == "ghp_" + "C" * 19  # not cut: a word as it is


def test_personal_data_at_a_cut_is_held_back_when_it_is_redacted() -> None:
    redactor = Redactor(personal_data=True)
    assert redactor.head("mail jane.doe@exam") == "mail " + CUT_REDACTED
    assert redactor.head("card 4111 1111 11") == "card " + CUT_REDACTED
    assert Redactor().head("mail jane.doe@exam") == "mail jane.doe@exam"


def test_the_runs_own_bookkeeping_is_what_a_records_folder_carries() -> None:
    """A copied workspace leaves stockade's records out but the run's own files in it."""
    for path in (BASELINE, OUTPUT_DIR, REPORT_DIR):
        first, rest = path.split("/", 1)
        assert first == STATE_DIR and rest.split("/")[0] in CARRIED
        assert not is_state(path) and not is_state(path + "/x.txt")
    for path in (".stockade/audit.db", "sub/.stockade/service.db", ".stockade/snapshots/objects/x"):
        assert is_state(path)
    assert not is_state(".stockade") and not is_state("stockade/audit.db")


def _unredacted(text: str) -> str:
    """``text`` without the cut marks and the redactor's own marks (what is left is the run's)."""
    return re.sub(r"\[REDACTED(?::\w+)?\]", "", CUT_MARK.sub("", text))


@settings(max_examples=400, deadline=None)
@given(
    secret=st.text(alphabet=string.ascii_uppercase, min_size=4, max_size=40),
    before=st.text(alphabet=string.ascii_lowercase + " \n.:", max_size=60),
    after=st.text(alphabet=string.ascii_lowercase + " \n.:", max_size=60),
    limit=st.integers(min_value=3, max_value=120),
)
def test_no_part_of_a_registered_secret_survives_a_cut_in_the_middle(
    secret: str, before: str, after: str, limit: int
) -> None:
    """A long observation keeps its head and its tail (``clip``, ``bound``): a secret the
    cut split kept its end in the tail, which the redactor, seeing half of it, wrote as it was
    (found from outside). Any cut, anywhere: not one of the secret's characters is written."""
    redactor = Redactor()
    redactor.add_secret(secret)
    out = redactor.text(clip(before + secret + after, limit).text)
    assert not set(_unredacted(out)) & set(string.ascii_uppercase), out


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(k for k, (_, v) in CREDENTIALS.items() if " " not in v)),
    before=st.text(alphabet=string.ascii_lowercase + " \n", max_size=40),
    limit=st.integers(min_value=3, max_value=120),
)
def test_no_part_of_a_credential_survives_a_cut_in_the_middle(kind: str, before: str, limit: int) -> None:
    """The same for a credential nobody registered, known by its shape only: the rest of the
    word the cut began is held back."""
    prefix, value = CREDENTIALS[kind]
    text = f"{before} {prefix}{value} and then some more words"
    whole = Redactor().text(text)  # a sample whose shape needs more (a URL's host) is not cut's
    out = Redactor().text(clip(text, limit).text)
    kept = _unredacted(out)
    for start in range(len(value) - 3):
        part = value[start : start + 4]
        assert part in whole or part not in kept, (kind, out)


def test_a_cut_in_plain_text_loses_only_the_word_it_split() -> None:
    out = Redactor().text(clip("the first words here, then a long middle, and the last words", 30).text)
    assert out == f"the first words here{cut_marker(30)}{CUT_REDACTED} words"
    assert "characters cut" in out  # the mark itself stays
    # a note with line breaks (an error saying why the output was not saved) stays one line
    assert cut_marker(5, "could not\nbe saved").count("\n") == 2
