"""Personal data's shapes (``redact_personal_data``, what ``Redactor(personal_data=True)`` and
the GDPR compliance profile turn on): e-mail addresses, phone numbers, IP addresses, payment
cards, IBANs, SSNs; and what a cut may have kept of one. Apart from the credentials' shapes:
it is a pass of its own, which a redactor runs only when asked.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from stockade.audit._secret_patterns import compile_patterns

__all__ = ["PERSONAL_DATA_PATTERNS", "PERSONAL_TAIL_PATTERNS", "redact_personal_data"]

# name -> pattern, replaced by [REDACTED:name] (cards only when their digits pass Luhn's check)
PERSONAL_DATA_PATTERNS: dict[str, str] = {
    "email": r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}\b",
    "iban": r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b",
    "card": r"\b\d(?:[ \-]?\d){12,18}\b",
    "ssn": r"\b\d{3}-\d{2}-\d{4}\b",
    "phone": r"(?:\+\d{1,3}[ .\-]?)?(?:\(\d{2,4}\)[ .\-]?|\b\d{2,4}[ .\-])\d{3,4}[ .\-]\d{3,4}\b",
    "ip": (
        r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b"
        r"|\b(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\b"
    ),
}
# The same for PERSONAL_DATA_PATTERNS: an e-mail address, a number (a card, a phone, an IPv4
# address, an SSN), an IBAN or an IPv6 address that the cut ended.
PERSONAL_TAIL_PATTERNS: dict[str, str] = {
    "email": r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]*\Z",
    "number": r"(?:\+|\(|\b\d)[\d .\-()]*\Z",
    "iban": r"\b[A-Z]{2}\d{2}[A-Z0-9 ]*\Z",
    "ipv6": r"\b[0-9A-Fa-f]{1,4}:[0-9A-Fa-f:]*\Z",
}
_PERSONAL = compile_patterns(PERSONAL_DATA_PATTERNS)
_ANY_PERSONAL = re.compile(r"@|\d{3}|[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,4}:")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _personal(name: str) -> Callable[[re.Match[str]], str]:
    def replace(match: re.Match[str]) -> str:
        if name == "card" and not _luhn(re.sub(r"\D", "", match.group(0))):
            return match.group(0)  # a long number, not a card
        return f"[REDACTED:{name}]"

    return replace


_PERSONAL_REPLACERS = [(pattern, _personal(name)) for name, pattern in _PERSONAL]


def redact_personal_data(text: str) -> str:
    """Replace what looks like personal data by ``[REDACTED:<kind>]`` (see the module's doc)."""
    if not _ANY_PERSONAL.search(text):
        return text
    for pattern, replace in _PERSONAL_REPLACERS:
        text = pattern.sub(replace, text)
    return text
