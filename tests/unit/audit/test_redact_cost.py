"""The redactor's cost grows with a text's length, never with its square.

An outside tester fed it ``"a." * n + " password=hunter2xyz"``: every ``.`` made a word
boundary, and from each a pattern scanned to the end of the run and back. 16 KB took two
minutes of the caller's thread (the audit log redacts on it); an agent's call of 256 KiB, hours.

The adversarial texts below are 16 KB each, of many shapes; a child process redacts them all
under a CPU limit that linear work stays far below and quadratic work far exceeds (a slow host
is no cause for a false failure: the limit is counted in CPU seconds, not on the clock).
"""

from __future__ import annotations

import resource
import subprocess
import sys

SIZE = 16 * 1024
# every text below, linear: ~20 CPU seconds on a 2-core CI host beside other tests; one quadratic
# shape (``"a." * n`` before a name, as it was): over two minutes by itself
CPU_SECONDS = 60

# A credential's opening, repeated: from each, a pattern scanned on for what ends its first part
# (``--user=…``, to the text's end for the ``:`` of ``user:password``; ``eyJ-…``, for a JWT's
# ``.``). Also read at LONG, where that work (quadratic) is many times the linear work.
LONG = 128 * 1024
LONG_CPU_SECONDS = 12  # the PREFIXES below, linear: about three seconds; quadratic: over a minute
PREFIXES = ["--user=", "--user ", "-u", "-u ", "-uu:", "--user='", "eyJ-", "eyJaaaa-"]

# Each repeated to SIZE, then as is, with a credential after it, or with a character that ends
# no value (the runs of a pattern's candidates reach no end of the text, nor a match).
# fmt: off
SHAPES = [
    "a.", "a-", "1.", "a:", "a@", "a@b.", "a.b@", "1 ", "1-", "(1", "+1 ", "12 ", "1:", "AB12 ",
    "=", '"', "'", "\\", "\\n", "\\u00", "`", "$(", " ", "\n", "_",
    "--password ", "-u a:", "--user a:", "password ", "password a1", "password=", "password='",
    'secret="', '"a.password": "', '\\"token\\": \\"', "token:\\", "x_pass=\n",
    "-----BEGIN", "-----BEGIN PRIVATE KEY-----", "-----BEGIN PRIVATE KEY-----\\n", "\nAAAA", " AAAA",
    "Bearer ", "Token 1", "Basic ", "a://b@", "a://b:", "a://",
    "sk-", "sk-a-", "ghp_", "xoxb-", "xoxa-a-", "AIza", "sk_live_", "glpat-", "hf_", "npm_", "AKIA",
    "eyJ", "eyJa.", "eyJaaaa.", *PREFIXES,
]
# fmt: on
ENDS = ["", " password=hunter2xyz", "!"]

CHILD = """
import sys
from stockade._cuts import cut_marker
from stockade.audit.redact import CodeText, Redactor, ShellText
shapes, ends, size = eval(sys.stdin.read())
redactor = Redactor(personal_data=True)
for shape in shapes:
    for end in ends:
        text = shape * (size // len(shape)) + end
        redactor.text(text)
        redactor.head(text)
        redactor.text(ShellText(text))
        redactor.text(CodeText(text))
        redactor.text(text[: size // 2] + cut_marker(5) + text[size // 2 :])
print("done")
"""


LONG_CHILD = """
import sys
from stockade.audit.redact import Redactor, ShellText
shapes, size = eval(sys.stdin.read())
redactor = Redactor()
for shape in shapes:
    text = shape * (size // len(shape)) + "!"
    redactor.text(text)
    redactor.text(ShellText(text))
print("done")
"""


def _redacted_within(child: str, data: object, cpu_seconds: int) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))

    done = subprocess.run(
        [sys.executable, "-c", child],
        input=repr(data),
        capture_output=True,
        text=True,
        preexec_fn=limit,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", (
        f"the redactor spent more than {cpu_seconds} CPU seconds (or failed): {done.stderr[-2000:]}"
    )


def test_adversarial_texts_are_redacted_in_linear_time() -> None:
    _redacted_within(CHILD, (SHAPES, ENDS, SIZE), CPU_SECONDS)


def test_a_credential_s_opening_repeated_is_redacted_in_linear_time() -> None:
    """``--user=--user=…`` (128 KB) took minutes: every ``--user=`` began a user, read to the end."""
    _redacted_within(LONG_CHILD, (PREFIXES, LONG), LONG_CPU_SECONDS)
