"""Untrusted text made safe to show (``stockade._display``): every character that a terminal
acts on, that reorders what a browser draws, or that is not seen at all is shown as its escape;
the words of an approval are that same text, and still stand for the exact action."""

from __future__ import annotations

import json

import pytest

from stockade._display import visible, visible_json
from stockade.policy.approval import ApprovalRequest
from stockade.policy.guards import describe, shown
from stockade.sandbox.ops import RunCode, RunCommand

# every range that is never shown raw, by its first and last character
RANGES = {
    "C0 controls": (0x00, 0x08),
    "C0 controls after tab and newline": (0x0B, 0x1F),
    "DEL and C1 controls": (0x7F, 0x9F),
    "arabic letter mark": (0x061C, 0x061C),
    "zero-width characters, LRM, RLM": (0x200B, 0x200F),
    "bidi embeddings and overrides": (0x202A, 0x202E),
    "word joiner and invisible operators": (0x2060, 0x2064),
    "bidi isolates": (0x2066, 0x2069),
    "byte order mark": (0xFEFF, 0xFEFF),
    "lone surrogates": (0xD800, 0xDFFF),
    "tag characters": (0xE0000, 0xE007F),
    # drawn as nothing or as a space (found from outside: `./sr\xadc/` was shown as `./src/`)
    "soft hyphen": (0x00AD, 0x00AD),
    "combining grapheme joiner": (0x034F, 0x034F),
    "Hangul fillers": (0x115F, 0x1160),
    "Khmer inherent vowels": (0x17B4, 0x17B5),
    "Mongolian vowel separator": (0x180E, 0x180E),
    "line and paragraph separators": (0x2028, 0x2029),
    "deprecated format characters": (0x206A, 0x206F),
    "Hangul filler": (0x3164, 0x3164),
    "variation selectors": (0xFE00, 0xFE0F),
    "halfwidth Hangul filler": (0xFFA0, 0xFFA0),
    "interlinear annotations": (0xFFF9, 0xFFFB),
    "musical format characters": (0x1D173, 0x1D17A),
    "variation selectors supplement": (0xE0100, 0xE01EF),
}
RLO, LRI, PDI, PDF = "\u202e", "\u2066", "\u2069", "\u202c"
# the tester's action: drawn as if `rm -r src` were inside the echoed string
TRICK = f'echo "clean the build folder{RLO}{LRI}"{PDI}{LRI} ; rm -r src ; true {PDI}{PDF}'


def escape_of(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


@pytest.mark.parametrize("name", RANGES)
def test_every_character_of_each_range_is_shown_as_its_escape(name: str) -> None:
    first, last = RANGES[name]
    for code in range(first, last + 1):
        text = f"a{chr(code)}b"
        assert visible(text) == f"a{escape_of(code)}b", hex(code)
        decoded = json.loads(visible_json(json.dumps(text, ensure_ascii=False)))
        assert decoded == text, hex(code)  # the same value, its character written as a JSON escape
        assert chr(code) not in visible_json(json.dumps(text, ensure_ascii=False))


def test_text_around_them_is_kept_as_it_is() -> None:
    text = "plain ASCII, accents é, CJK 漢字, RTL letters עברית, emoji 🙂, a\ttab\nand lines"
    assert visible(text) == text
    assert visible(text, one_line=True) == text.replace("\t", "\\t").replace("\n", "\\n")
    assert visible_json(json.dumps(text, ensure_ascii=False)) == json.dumps(text, ensure_ascii=False)


def test_the_trick_the_tester_played_on_the_approver_is_shown_for_what_it_is() -> None:
    assert visible(TRICK) == (
        'echo "clean the build folder\\u202e\\u2066"\\u2069\\u2066 ; rm -r src ; true \\u2069\\u202c'
    )
    assert visible("rm -r ./sr\u200bc") == "rm -r ./sr\\u200bc"  # read as ./src


def test_an_approval_shows_the_escapes_and_is_bound_to_the_exact_action() -> None:
    """`describe()` joined the argv with shlex, which keeps bidi controls raw: every surface
    (the terminal, the service's API, the run viewer) showed what the browser drew."""
    action = describe(RunCommand(argv=("/bin/sh", "-c", TRICK)))
    assert not any(c in action for c in (RLO, LRI, PDI, PDF)) and "\\u202e" in action
    assert "the exact action is sha256" in action
    # the literal text of the escapes reads the same, but is another action: another approval
    literal = describe(RunCommand(argv=("/bin/sh", "-c", visible(TRICK))))
    assert literal.split(" [shown with")[0] == action.split(" [shown with")[0]
    requests = [
        ApprovalRequest(run_id="r", action=a, rule="commands.approve", reason="") for a in (action, literal)
    ]
    assert requests[0].id != requests[1].id


def test_an_action_with_nothing_to_escape_is_shown_as_it_was() -> None:
    assert describe(RunCommand(argv=("rm", "-r", "build"))) == "run `rm -r build`"
    assert shown("run `echo hello`") == "run `echo hello`"


def test_code_and_a_long_action_are_escaped_too() -> None:
    code = describe(RunCode(code=f"print('hi')\n# {RLO}\nimport os"))
    assert RLO not in code and "\\u202e" in code and "\nimport os" in code  # lines kept
    long = shown("x" * 5000 + RLO + "y" * 5000)
    assert RLO not in long and "characters not shown; the whole is sha256" in long
