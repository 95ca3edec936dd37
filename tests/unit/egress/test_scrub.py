"""The scrub of a credential host's reply body on its own: the secret's forms found in any
letter case across the borders of the chunks it comes in, and a compressed body decoded
whole, however many gzip members it is, giving the loop turns between many of them."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable

import pytest

from stockade.egress._gate import Forms
from stockade.egress._scrub import MEMBERS_PER_TURN, Decoder, Scrubber

SECRET = b"Tok-Zq9xKp3LmW7vT2nR8sY4bQ6"
FORMS = Forms.of([SECRET, b"Bearer " + SECRET, SECRET.hex().encode()])


@pytest.mark.parametrize("echo", [SECRET, SECRET.lower(), SECRET.upper(), SECRET.swapcase()])
def test_a_form_in_any_letter_case_is_scrubbed_wherever_the_chunks_cut_it(echo: bytes) -> None:
    text = b"you sent: Bearer " + echo + b" and " + SECRET.hex().upper().encode() + b" twice"
    for at in range(len(text) + 1):
        scrubber = Scrubber(FORMS)
        got = scrubber.feed(text[:at]) + scrubber.feed(text[at:]) + scrubber.end()
        assert got == b"you sent: [REDACTED] and [REDACTED] twice", at


def test_what_the_scrub_put_in_is_not_looked_at_again() -> None:
    """A secret that is a word of the replacement itself: each byte is looked at once, so
    ``[REDACTED]`` held back for the next chunk is not replaced again, chunk after chunk."""
    scrubber = Scrubber(Forms.of([b"redacted"]))
    got = scrubber.feed(b"x redacted") + b"".join(scrubber.feed(b"y") for _ in range(20)) + scrubber.end()
    assert got == b"x [REDACTED]" + b"y" * 20


def test_gzip_members_are_each_decoded_with_a_turn_for_the_loop_between_many() -> None:
    """Each member is a new decompressor (~1 µs): a read of thousands of empty members held
    the loop every sandbox shares; every ``MEMBERS_PER_TURN`` of them an empty piece asks
    for a turn."""
    body = gzip.compress(b"first ") + gzip.compress(b"") * (3 * MEMBERS_PER_TURN) + gzip.compress(b"last")
    pieces = list(Decoder("gzip").feed(body))
    assert b"".join(pieces) == b"first last" and pieces.count(b"") == 3


@pytest.mark.parametrize(
    ("coding", "body"),
    # mtime=0: a gzip header holds the time it was made, and xdist's workers must draw the
    # same ids
    [("gzip", gzip.compress(b"ok", mtime=0) + b"not gzip"), ("deflate", zlib.compress(b"ok") + b"more")],
    ids=["gzip", "deflate"],
)
def test_bytes_after_a_compressed_body_cut_the_reply(coding: str, body: bytes) -> None:
    """None of a reply is dropped unread: what follows the end is a member, or an error."""
    with pytest.raises(ConnectionError):
        list(Decoder(coding).feed(body))


def test_copies_of_a_form_side_by_side_are_one_run_found_once_each() -> None:
    """A form found at every byte of a self-overlapping run ("aaaa" in 256 KiB of a's) made a
    list of a quarter million matches; copies that touch are one ``[REDACTED]``."""
    forms = Forms.of([b"aaaa"])
    assert forms.runs(b"x" + b"a" * 4096 + b"x") == [(1, 4097)]
    assert forms.scrub(SECRET * 3) == SECRET * 3
    assert Forms.of([SECRET]).scrub(b"<" + SECRET * 3 + b">") == b"<[REDACTED]>"


@pytest.mark.parametrize("spelled", [str.upper, str.lower, str.casefold], ids=["upper", "lower", "casefold"])
def test_a_secret_beyond_ascii_is_scrubbed_in_another_letter_case_too(spelled: Callable[[str], str]) -> None:
    """The scan lowers ASCII letters only: an upper-cased echo of ``tok-Grüße`` kept its Ü."""
    secret = "tok-Grüße-1234567890"
    echo = ("you sent: " + spelled(secret)).encode()
    assert Forms.of([secret.encode()]).scrub(echo) == b"you sent: [REDACTED]"
