"""Redaction: secrets are removed before anything is written (store, logs, spans).

A ``Redactor`` is a pipeline of plain callables ``(text) -> text`` applied to every string
of an event (keys and values, at any depth), as structlog processors are applied to an event
dict; add your own to the pipeline. Two more rules need no pipeline entry:

- values whose *key* names a credential (``password``, ``api_key``, ``accessToken``,
  ``PGPASSWORD``, ``X-Api-Key``, ``api_key_list``, ...) are replaced whole, whatever they are
  (a string, a number, a list, an object); not the paths of a map keyed by paths (``files``:
  path -> content), whose contents are redacted as text;
- ``SecretValues``: the caller registers the exact values it hands to sandboxes (environment
  variables, tokens) with ``redactor.add_secret(value)``; they are replaced wherever they
  appear, even inside longer text.

``redact_tokens`` catches what looks like a credential even when nobody registered it:
``sk-...`` API keys, GitHub, Stripe, GitLab, Hugging Face and npm tokens, AWS access key ids,
``Bearer ...`` (``token ...``), JWTs, private key blocks (OpenPGP's too), the cookies of a
``Cookie:`` header and of curl's ``-b``, a Digest's ``response``, a signed URL's signature,
openssl's ``-passin pass:x``, ``aws configure set``'s secrets, XML's ``<password>x</password>``, a
YAML value on the next line, values assigned to a credential's name (``PGPASSWORD=x``,
``SECRET_KEY=x``, ``OPENAI_KEY=x``, ``"password": "x"``, ``secret='a b'``, ``password => x``),
given to a credential's flag (``--password x``, ``--api-key x``, ``curl -u user:x``), and the password of
a URL (``https://user:x@host``). A value ends where a shell would end it (``;``, ``|``, ``$(``
..., a quote or a newline; a character a backslash escapes does not end it): what follows is
what a command did, never hidden. A private key block ends at its END line, or at the first
line a key's body does not hold. ``flag_value`` finds a flag's value given as an argv word of
its own (``["--password", "x"]``).

A command's text (``ShellText``: ``sh -c``'s script, a command tool's ``command``) is read as
the shell reads it, from its start through its quotes (``Redactor.shell``): the patterns are
applied to each of its words alone, since a regex cannot tell a quote that opens a value from
one that closes an earlier string (``X="PASSWORD="ab rm -rf src""`` runs ``rm``); and to each
as the shell joins its quoted parts (``PASSWORD=""x``, ``PASSWORD="a"'b'``). A
here-document's text is read so too, from the line after its ``<<`` to its word: its words, a
name with ``=`` and its value (``PASSWORD = "x"``), and each private key in it whole.
A program's source in another language (``CodeText``: run_code's Python, node, ...) is
redacted statement by statement (``Redactor.code``): a value ends at its line's end, at a ``;``
and at the quote that closes its string; a string given to a credential's name is hidden whole,
as the language reads it (triple quotes, ``\\'``), and an expression given to one is kept.

A text someone cut before it reached the redactor (a sandbox caps the words of an exec it
reports) may end with half a credential, which no pattern and no registered value matches:
``Redactor.head`` replaces what at its end may begin one (``TAIL_PATTERNS``, a registered
secret's prefix) by ``[REDACTED:cut]``. A text cut in the middle says so with ``stockade._cuts.cut_marker``
(a long tool output, a quoted argument): the redactor treats what comes before each such mark
so, and replaces what comes right after it that may end a secret (a registered secret's
suffix, the rest of a word) by ``[REDACTED:cut]`` too. A text nobody cut (a command) has its
mark-shaped lines made plain first (``stockade._cuts.plain``), so that none hides a word.

``redact_personal_data`` (``Redactor(personal_data=True)``; what the GDPR compliance profile
turns on) replaces what looks like personal data: e-mail addresses, phone numbers, IP
addresses, payment card numbers (Luhn-checked), IBANs and US social security numbers. Patterns
find shapes, not meaning: a name, an address in words or an identifier of your own domain
passes; add a processor for those.
"""

from __future__ import annotations

import functools
import math
import re
import string
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stockade import exceptions as exc
from stockade._cuts import CUT_MARK
from stockade.audit.events import JSONValue

__all__ = [
    "CUT_REDACTED",
    "MIN_SECRET_LENGTH",
    "PERSONAL_DATA_PATTERNS",
    "PERSONAL_TAIL_PATTERNS",
    "REDACTED",
    "TAIL_PATTERNS",
    "TOKEN_PATTERNS",
    "CodeText",
    "Redactor",
    "SecretValues",
    "ShellText",
    "StringProcessor",
    "flag_value",
    "redact_personal_data",
    "redact_tokens",
]

StringProcessor = Callable[[str], str]
REDACTED = "[REDACTED]"
MIN_SECRET_LENGTH = 4
# Keys, names and ids repeat in nearly every event: their redaction is remembered.
CACHED_LENGTH = 64
CACHE_SIZE = 4096

# What a name that holds a credential ends with, in text (``PGPASSWORD=``, ``"accessToken":``,
# ``db_pass=``; a bare ``pass`` is a word too often: ``bypass``, ``compass``).
# ``SECRET_KEY=``, ``PRIVATE_KEY=``, ``OPENAI_KEY=``: a key of a kind that is secret, or of a
# service whose keys are (``_SECRET_KEYS``); not a bare ``key`` (``sort_key``, ``cache_key``,
# ``primary_key``, ``public_key``).
_SECRET_KEYS = (
    "secret|private|signing|encryption|master|account|app|auth|subscription"
    "|openai|anthropic|azure|stripe|sendgrid|mailgun|twilio"
)
_NAMES = (
    r"passwords?|passwd|passphrase|secret|token|api[_\-]?key|access[_\-]?key|[_.\-]pass"
    rf"|(?:{_SECRET_KEYS})[_\-]?key"
)
# The name before a value, from the start of its run of name characters (``db.password``,
# ``x-api-key``): written ``\b[\w.\-]*``, a match was tried from every word boundary of a run, each
# a scan to its end (``a.a.a.…`` took minutes); from the run's start only, once per run.
_NAMED = rf"(?<![\w.\-])[\w.\-]*(?i:{_NAMES})"
# What ends a value that is not quoted: besides a space or a quote, what a shell reads as the
# end of a word (``;`` ``&`` ``|`` ``<`` ``>`` ``(`` ``)``) or the start of an expansion (``$``,
# a backtick). A value ran through them: ``--token x;rm -rf src`` hid the ``rm`` in the trail.
# Tokens, URL-encoded and base64 secrets hold none of them.
_SHELL = r";&|<>$()`"
# A character of a quoted value: not its quote, nor what runs a command even between double
# quotes (``$(``, ``${``, a backtick).
_QUOTED = r"(?:(?!\$[({])[^'\"\n\\`])"
# A character of a double-quoted value: one of ``_QUOTED`` or one a backslash escapes (the
# shell keeps ``\"``, ``\$``, ... inside the quotes); never ``'``: a value in single quotes
# that ran past one (``echo '"password": "\'; echo PWNED`` ) hid the command after it.
_DQ = rf"(?:{_QUOTED}|\\[^\n'])"
# A character of a single-quoted value: the shell escapes nothing there, a backslash is one.
_SQ = rf"(?:{_QUOTED}|\\)"
# A character of an unquoted value: not a space, a quote, a backslash nor what ends a shell's
# word; or any a backslash escapes (``PGPASSWORD=Xy\$9k`` is the one word ``Xy$9k``).
_BARE = rf"(?:[^\s\"'\\{_SHELL}]|\\[^\n])"
# A quoted value longer than this is no credential: a value stops being read past it (a longer
# token has no space, and the patterns of unquoted values take it whole).
_LONGEST = 256
# How a value is given to a name: ``=``, ``:``, and ``=>`` (Perl, PHP, Ruby); not ``==``.
_GIVES = r"(?:=>|[=:](?![=>]))"
# A private key's body: its lines (also written ``\n`` in a string), each base64, an encrypted
# key's ``Proc-Type:``/``DEK-Info:`` header or blank, up to its END line; a line of anything
# else is no key's (``-----BEGIN PRIVATE KEY----- ; echo PWNED`` hid the echo to the end).
# A key on one line (a variable echoed unquoted) needs its END.
_NL = r"(?:\r?\n|(?:\\r)?\\n)"
_PEM_END = r"-----END [A-Z ]*PRIVATE KEY-----"
_PEM_BODY = (
    rf"(?:[ \t]+(?:[A-Za-z0-9+/=]+[ \t]+)*{_PEM_END}"
    rf"|(?:{_NL}[ \t]*(?:(?:Proc-Type|DEK-Info):[ \t]*[\w,\-]+|[A-Za-z0-9+/=]+[ \t]*)?(?={_NL}|\Z))*"
    rf"(?:{_NL}[ \t]*{_PEM_END})?)"
)
# A character of an assigned value: one of ``_BARE`` but ``,`` (a list's next item); after a
# quote, a backslash alone, which ends the value at an escaped quote (``\"token\": \"x\"``: JSON
# in a string). The pattern names that quote ``opened``.
_ASSIGNED = rf"(?(opened)(?:[^\s\"',\\{_SHELL}]|\\(?![\"']))|(?!,){_BARE})"
# A JSON string's character: no quote, newline or backslash, but one of JSON's escapes.
_JSON = rf"(?:{_QUOTED}|\\(?:[\"\\/bfnrt]|u[0-9A-Fa-f]{{4}}))"

# A cookie's name and value, and what gives them: an HTTP header, curl's flag.
_COOKIE_NAME = rf"[^\s=;'\"\\{_SHELL}]{{1,256}}"
_COOKIE_VALUE = rf"(?:(?!,){_BARE})"
_COOKIE_OPENS = r"(?:\b(?i:cookie)[ \t]*:[ \t]*|(?<![\w\-])(?:-b|--cookie)(?:[ \t]+|=)['\"]?)"
# A signed URL's signature parameter (Azure's SAS, AWS's and Google's presigned URLs).
_SIGNATURE_PARAM = r"[?&;](?:sig|[Ss]ignature|(?i:x-(?:amz|goog)-signature))="
# A character of an XML element's text that may be a credential's: none that ends a shell's
# word, but the escapes XML writes them as.
_XML_VALUE = rf"(?:[^\s<>'\"\\{_SHELL}]|&(?:amp|lt|gt|quot|apos|#x?[0-9A-Fa-f]{{1,6}});)"
# curl's user flag: ``-u x``, ``-ux`` (a user that begins with a letter), ``--user x``, ``--user=x``.
_USER_OPENS = r"(?<![\w\-])(?:-u(?:[ \t]+|(?=[A-Za-z]))|--user(?:[ \t]+|=))"
# Its user, up to the ``:``: a bounded run, since a user is short and from every ``--user=`` of
# ``--user=--user=…`` an unbounded one scanned to the text's end for a ``:`` (quadratic).
_USER = rf"[^\s:'\"{_SHELL}]{{1,{_LONGEST}}}"

# name -> pattern; the whole match is replaced by [REDACTED:name], except the named group
# ``keep`` (the scheme word of ``Bearer x``, the name in ``password=x``), which stays.
# (A prefix is written before its ``\b``, as a look behind: a pattern that begins with a literal
# is searched for as one, thirty times faster than one tried at every position.)
TOKEN_PATTERNS: dict[str, str] = {
    "private_key": rf"-----BEGIN [A-Z ]*PRIVATE KEY-----{_PEM_BODY}",
    # an OpenPGP secret key's armor: its headers (words, never what ends a shell's command), a
    # blank line, base64 lines and its checksum, up to its END line
    "pgp_private_key": (
        rf"-----BEGIN PGP PRIVATE KEY BLOCK-----(?:{_NL}[ \t]*(?:[\w\-]+:[ \t][\w .,@+/:=\-]*"
        rf"|[A-Za-z0-9+/=]+[ \t]*)?(?={_NL}|\Z))*(?:{_NL}[ \t]*-----END PGP PRIVATE KEY BLOCK-----)?"
    ),
    "api_key": r"sk-(?<!\wsk-)(?:[A-Za-z0-9]+-)*[A-Za-z0-9_\-]{16,}",
    "github_token": r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{22,})",
    "aws_access_key": r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",
    "slack_token": r"xox(?<!\wxox)[abposr]-[A-Za-z0-9\-]{10,}",
    "google_api_key": r"AIza(?<!\wAIza)[0-9A-Za-z_\-]{35}",
    # Stripe's secret and restricted keys (sk_live_, rk_test_, ...; its pk_ keys are public)
    "stripe_key": r"[rs]k_(?<!\w[rs]k_)(?:live|test)_[0-9A-Za-z]{24,}",
    "gitlab_token": r"glpat-(?<!\wglpat-)[0-9A-Za-z_\-]{20,}",
    # hf_ and 34 letters; not an identifier (hf_hub_download has underscores)
    "huggingface_token": r"hf_(?<!\whf_)[A-Za-z0-9]{30,}\b",
    "npm_token": r"npm_(?<!\wnpm_)[A-Za-z0-9]{36}\b",
    # a JWT begins a word (not after a ``-``: from each ``eyJ`` of ``eyJ-eyJ-…`` a scan ran to the
    # text's end for a ``.``)
    "jwt": r"eyJ(?<![\w\-]eyJ)[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]{4,}",
    # an HTTP credential: the token must contain a digit, so that "Token ordinaryword" stays
    "bearer": r"(?P<keep>\b(?:[Bb]earer|Basic|[Tt]oken)\s+)(?=[A-Za-z\-._~+/]*\d)[A-Za-z0-9\-._~+/]{12,}=*",
    # Cookie: a=1; session=x (an HTTP header), curl -b 'session=x' (--cookie): every cookie's
    # value, from the first one's (which may be short: the values together hold 4 characters)
    "cookie": (
        rf"(?P<keep>{_COOKIE_OPENS}{_COOKIE_NAME}=)(?!\[REDACTED)(?=(?:{_COOKIE_VALUE}|;[ \t]?){{4}})"
        rf"{_COOKIE_VALUE}{{0,{_LONGEST}}}(?:;[ \t]?{_COOKIE_NAME}={_COOKIE_VALUE}{{0,{_LONGEST}}}){{0,64}}"
    ),
    # Authorization: Digest ..., response="6629fae4..." (what a password and a nonce hash to)
    "digest_response": r"(?P<keep>response=(?<!\wresponse=)\"?)[0-9a-fA-F]{32,128}(?![0-9A-Za-z])",
    # ?sv=...&sig=x (Azure SAS), X-Amz-Signature=x, X-Goog-Signature=x: a signed URL's signature
    "url_signature": rf"(?P<keep>{_SIGNATURE_PARAM})(?!\[REDACTED)[^\s#'\"\\{_SHELL}]{{4,}}",
    # <password>x</password>, <SecretAccessKey>x</SecretAccessKey> (XML: AWS STS answers so);
    # what XML escapes (``&amp;``) the value holds as it
    "xml_element": (
        rf"(?P<keep><(?P<tag>[\w.:\-]{{0,128}}(?i:{_NAMES}))>)(?!\[REDACTED)"
        rf"{_XML_VALUE}{{1,{_LONGEST}}}(?=</(?P=tag)>)"
    ),
    # openssl ... -passin pass:x (-passout, -pass); its env:NAME, file:path are no secrets
    "openssl_pass": (
        rf"(?P<keep>(?<![\w\-])-pass(?:in|out)?[ \t]+(?P<q>['\"])?pass:)(?!\[REDACTED)"
        rf"(?(q){_QUOTED}|{_BARE}){{1,{_LONGEST}}}"
    ),
    # aws configure set aws_secret_access_key x (a value after a space)
    "aws_configure": (
        rf"(?P<keep>\b(?i:aws_(?:secret_access_key|session_token))[ \t]+['\"]?)(?![\-\[=])"
        rf"(?:(?<='){_SQ}{{4,{_LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{_LONGEST}}}(?=\")|(?<!['\"]){_BARE}{{4,}})"
    ),
    # password:\n  x, token: |\n  x (YAML: the value on the next line, indented; a mapping's key
    # there, ``user: x``, a list's ``- x`` or a comment is none)
    "yaml_next_line": (
        rf"(?P<keep>(?i:{_NAMES})[ \t]*:[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+['\"]?)"
        rf"(?![\-\[#{{]|[^\s:'\"]{{0,256}}:(?:\s|\Z))(?!\[REDACTED)(?:(?!,){_BARE}){{4,}}"
    ),
    # "password": "x y" (JSON, its value up to the closing quote, spaces and escapes included)
    "json_assignment": (
        rf"(?P<keep>\"[\w.\-]*(?i:{_NAMES})\"[ \t]*:[ \t]*\")(?!\[REDACTED){_JSON}{{4,{_LONGEST}}}(?=\")"
    ),
    # passphrase='open sesame', TOKEN="a b c", password => 'x': a quoted value, up to its quote
    "quoted_assignment": (
        rf"(?P<keep>{_NAMED}[ \t]*{_GIVES}[ \t]*['\"])(?!\[REDACTED)"
        rf"(?:(?<='){_SQ}{{4,{_LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{_LONGEST}}}(?=\"))"
    ),
    # https://user:password@host, redis://:password@host: the password of a URL's user information
    # (a user that is a mark already, "[REDACTED:github_token]", is no user and password)
    "url_password": (
        r"(?P<keep>(?<=[A-Za-z0-9+.\-])://(?!\[REDACTED)[^\s/:@'\"]*:)(?!\[REDACTED)"
        rf"[^\s/@'\"{_SHELL}]+(?=@)"
    ),
    # --password hunter2, --api-key abcd (a command's flag, its value after a space)
    "flag": (
        rf"(?P<keep>(?<![\w\-])--?[\w\-]*(?i:{_NAMES})[ \t]+['\"]?)(?![\-\[])"
        rf"(?:(?<='){_SQ}{{4,{_LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{_LONGEST}}}(?=\")|(?<!['\"]){_BARE}{{4,}})"
    ),
    # curl -u user:password, --user=user:password, -uuser:password (a user that is a number,
    # docker's -u 1000:1000, is a uid and gid)
    "user_password": (
        rf"(?P<keep>{_USER_OPENS}['\"]?{_USER}:)"
        rf"(?!\[REDACTED|\d+(?![^\s\"'{_SHELL}])){_BARE}+"
    ),
    # password=x, PGPASSWORD=x, accessToken: x, 'secret': 'x', \"token\": \"x\" (JSON in a string)
    "assignment": (
        rf"(?P<keep>{_NAMED}(?:\\?[\"'])?[ \t]*{_GIVES}[ \t]*(?P<opened>\\?[\"'])?)"
        rf"(?!\[REDACTED|(?i:true|false|null|none)\b){_ASSIGNED}{{4,}}"
    ),
    # "db failed: password Zq9hunter2" (an error message): a word after the word password that
    # holds a letter and a digit, so that "password is required" and "password reset" stay
    "spaced_password": (
        r"(?P<keep>\b(?i:password|passwd|passphrase)[ \t]+)(?!\[REDACTED)"
        rf"(?={_BARE}*[0-9])(?={_BARE}*[A-Za-z])(?:(?!,){_BARE}){{6,}}"
    ),
}

# name -> what may be the head of a TOKEN_PATTERNS match that a cut ended: the same credential
# up to the end of the text, whatever its length there (no pattern knows a credential's prefix).
# Only for a text someone cut before it was redacted (``Redactor.head``); a cut inside the
# fixed part before the value (``gh``, ``PGPASS``) holds nothing secret yet.
TAIL_PATTERNS: dict[str, str] = {
    "api_key": r"\bsk-[A-Za-z0-9_\-]*\Z",
    "github_token": r"\b(?:gh[pousr]_|github_pat_)[A-Za-z0-9_]*\Z",
    "aws_access_key": r"\b(?:AKIA|ASIA)[A-Z0-9]{0,16}\Z",
    "slack_token": r"\bxox[abposr]-[A-Za-z0-9\-]*\Z",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{0,35}\Z",
    "stripe_key": r"\b[rs]k_(?:live|test)_[0-9A-Za-z]*\Z",
    "gitlab_token": r"\bglpat-[0-9A-Za-z_\-]*\Z",
    "huggingface_token": r"\bhf_[A-Za-z0-9]*\Z",
    "npm_token": r"\bnpm_[A-Za-z0-9]*\Z",
    "jwt": r"\beyJ[A-Za-z0-9_\-.]*\Z",
    "bearer": r"(?P<keep>\b(?:[Bb]earer|Basic|[Tt]oken)\s+)[A-Za-z0-9\-._~+/]+=*\Z",
    "cookie": (rf"(?P<keep>{_COOKIE_OPENS}{_COOKIE_NAME}=)(?!\[REDACTED)(?:{_COOKIE_VALUE}|;[ \t]?|=)*\\?\Z"),
    "digest_response": r"(?P<keep>response=(?<!\wresponse=)\"?)[0-9a-fA-F]{0,128}\Z",
    "url_signature": rf"(?P<keep>{_SIGNATURE_PARAM})(?!\[REDACTED)[^\s#'\"\\{_SHELL}]*\Z",
    "xml_element": (
        rf"(?P<keep><[\w.:\-]{{0,128}}(?i:{_NAMES})>)(?!\[REDACTED)(?:{_XML_VALUE}|&[#\w]{{0,8}}\Z)*\Z"
    ),
    "openssl_pass": (
        rf"(?P<keep>(?<![\w\-])-pass(?:in|out)?[ \t]+(?P<q>['\"])?pass:)(?!\[REDACTED)"
        rf"(?(q){_QUOTED}|{_BARE})*\\?\Z"
    ),
    "aws_configure": (
        rf"(?P<keep>\b(?i:aws_(?:secret_access_key|session_token))[ \t]+['\"]?)(?![\-\[=])"
        rf"(?:(?<='){_SQ}{{0,{_LONGEST}}}|(?<=\"){_DQ}{{0,{_LONGEST}}}\\?|(?<!['\"]){_BARE}*\\?)\Z"
    ),
    "yaml_next_line": (
        rf"(?P<keep>(?i:{_NAMES})[ \t]*:[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+['\"]?)"
        rf"(?![\-\[#{{]|[^\s:'\"]{{0,256}}:(?:\s|\Z))(?!\[REDACTED){_BARE}*\\?\Z"
    ),
    "json_assignment": (
        rf"(?P<keep>\"[\w.\-]*(?i:{_NAMES})\"[ \t]*:[ \t]*\")(?!\[REDACTED)"
        rf"{_JSON}{{0,{_LONGEST}}}(?:\\(?:u[0-9A-Fa-f]{{0,3}})?)?\Z"
    ),
    "quoted_assignment": (
        rf"(?P<keep>{_NAMED}[ \t]*{_GIVES}[ \t]*['\"])(?!\[REDACTED)"
        rf"(?:(?<='){_SQ}{{0,{_LONGEST}}}|(?<=\"){_DQ}{{0,{_LONGEST}}}\\?)\Z"
    ),
    "url_password": (
        r"(?P<keep>(?<=[A-Za-z0-9+.\-])://(?!\[REDACTED)[^\s/:@'\"]*:)(?!\[REDACTED)"
        rf"[^\s/@'\"{_SHELL}]*\Z"
    ),
    "flag": (
        rf"(?P<keep>(?<![\w\-])--?[\w\-]*(?i:{_NAMES})[ \t]+['\"]?)(?![\-\[])"
        rf"(?:(?<='){_SQ}{{0,{_LONGEST}}}|(?<=\"){_DQ}{{0,{_LONGEST}}}\\?|(?<!['\"]){_BARE}*\\?)\Z"
    ),
    "user_password": (
        rf"(?P<keep>{_USER_OPENS}['\"]?{_USER}:)(?!\[REDACTED)"
        rf"{_BARE}*\\?\Z"
    ),
    "assignment": (
        rf"(?P<keep>{_NAMED}(?:\\?[\"'])?[ \t]*{_GIVES}[ \t]*(?P<opened>\\?[\"'])?)"
        rf"(?!\[REDACTED){_ASSIGNED}*\\?\Z"
    ),
    "spaced_password": (
        rf"(?P<keep>\b(?i:password|passwd|passphrase)[ \t]+)(?!\[REDACTED)(?:(?!,){_BARE})*\\?\Z"
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
CUT_REDACTED = "[REDACTED:cut]"  # what may have begun a credential where a text was cut
# What right after a cut may be the end of a credential: the rest of its word, which ends where
# the shell ends one (``;`` ``|`` ``$`` ...; a backslash escapes one); for personal data, the
# rest of a number (a phone number's groups) too.
_LEAD = re.compile(rf"(?:[^\s\"',\\\[\]{{}}{_SHELL}]|\\[^\n])*")
_PERSONAL_LEAD = re.compile(r"[^\s\"',;&|<>$`\[\]{}]*(?:[\d .\-()]*\d)?")
_HEAD_ROUNDS = 8  # a tail held back, then the tail of what is left, ...: past this, nothing is kept

# A key naming a credential, once spelled snake_case (``accessToken`` -> ``access_token``,
# ``X-Api-Key`` -> ``x_api_key``): it ends with one of these words (``PGPASSWORD`` too), or
# names a list of them. Not ``tokens`` (``max_tokens`` is a count), nor a bare ``key``.
_SENSITIVE_KEY = re.compile(
    r"(?:password|passwd|passphrase|secret|token|api_?key|authorization|credential|cookie"
    rf"|(?:^|_)(?:access|{_SECRET_KEYS})_?key)(?:_list)?$"
    r"|(?:password|passwd|passphrase|secret|api_?key|credential|cookie)s(?:_list)?$"
)

# A key whose map is keyed by paths (``run_code``'s ``files``: path -> content): its keys name
# files, not credentials; a file's content is redacted as any text (``x_token``'s content was
# replaced whole, and the script it held was recorded nowhere).
_PATH_MAPS = frozenset({"files"})


@functools.lru_cache(maxsize=CACHE_SIZE)
def _sensitive_key(name: str) -> bool:
    snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return _SENSITIVE_KEY.search(re.sub(r"[\s.\-]+", "_", snake)) is not None


def _held(value: object) -> bool:
    """Whether a value under a credential's key holds anything (``None``, a flag, "" do not)."""
    return value is not None and not isinstance(value, bool) and value != ""


def _compile(patterns: Mapping[str, str]) -> list[tuple[str, re.Pattern[str]]]:
    return [(name, re.compile(pattern)) for name, pattern in patterns.items()]


_COMPILED = _compile(TOKEN_PATTERNS)
# One pass to rule out the common case (no credential-looking text at all) cheaply.
_ANY = re.compile("|".join(f"(?:{p.replace('?P<keep>', '')})" for p in TOKEN_PATTERNS.values()))
# And before it, a cheaper one: what every pattern holds literally (a name, a prefix, "://").
# Most text holds none, and a search for these costs a tenth of ``_ANY``'s.
_WORDS = re.compile(
    rf"(?i:{_NAMES})|sk-|gh[pousr]_|github_pat_|AKIA|ASIA|xox[abposr]-|AIza|[rs]k_(?:live|test)_|glpat-"
    r"|hf_|npm_|eyJ|[Bb]earer|Basic|[Tt]oken|(?i:cookie)|://|-----BEGIN|(?<![\w\-])-(?:u|-user)[ \t]"
    rf"|{_USER_OPENS}|(?<![\w\-])-b[ \t]|response=|{_SIGNATURE_PARAM}|-pass|(?i:aws_)"
)


def _replacer(name: str) -> Callable[[re.Match[str]], str]:
    def replace(match: re.Match[str]) -> str:
        keep = match.groupdict().get("keep") or ""
        return f"{keep}[REDACTED:{name}]"

    return replace


_REPLACERS = [(pattern, _replacer(name)) for name, pattern in _COMPILED]


def redact_tokens(text: str) -> str:
    """Replace credential-shaped substrings by ``[REDACTED:<kind>]``."""
    if not _WORDS.search(text) or not _ANY.search(text):
        return text
    for pattern, replace in _REPLACERS:
        text = pattern.sub(replace, text)
    return text


# A word of an argv that is a credential's flag alone (``--password``, ``--api-key``; not ``-p``,
# which is a port, a parent or a path as often), and the user flag of curl and its kin.
_FLAG_WORD = re.compile(rf"--?[\w\-]*(?i:{_NAMES})")
_USER_FLAGS = frozenset({"-u", "--user"})
_USER_WORD = re.compile(r"([^:]+:)(?!\d+\Z)(.+)", re.DOTALL)  # user:password, not uid:gid
_COOKIE_FLAGS = frozenset({"-b", "--cookie"})
_COOKIE_WORD = re.compile(r"([^=;\s]+=)(.+)", re.DOTALL)  # name=value, not a cookie file
_OPENSSL_PASS = frozenset({"-pass", "-passin", "-passout"})
_AWS_NAME = re.compile(r"(?i:aws_(?:secret_access_key|session_token))")
# curl and its kin: the programs whose ``-u`` is a user and password and ``-b`` cookies
# (``python3 -u`` is unbuffered, ``sort -u`` unique, ``cp -b`` a backup).
_HTTP_CLIENTS = frozenset({"curl", "curlie", "wget", "http", "https", "xh", "xhs"})
# What runs the program its next word names (``sudo curl``), and an assignment before it.
_WRAPPERS = frozenset({"sudo", "env", "command", "exec", "nohup", "time", "builtin", "xargs"})
_ASSIGNS = re.compile(r"[A-Za-z_]\w*=")


def command_program(words: Iterable[str]) -> str:
    """The name of the program a command's words run (``/usr/bin/curl`` is ``curl``): its first
    word that is no assignment, option nor wrapper (``FOO=1 sudo -E curl`` runs ``curl``)."""
    for word in words:
        if not _before_program(word):
            return word.rsplit("/", 1)[-1]
    return ""


def _before_program(word: str) -> bool:
    return _ASSIGNS.match(word) is not None or word.startswith("-") or word in _WRAPPERS


def flag_value(words: Sequence[str], at: int) -> str | None:
    """What replaces ``words[at]``, a word of an argv, when it is the value of a credential's
    flag given as a word of its own (``["--password", "x"]``, curl's ``["-u", "user:x"]``,
    openssl's ``["-passin", "pass:x"]``): each word redacted alone shows none of them.
    ``None``: it is not one."""
    before, word = (words[at - 1] if at else ""), words[at]
    if not word or word.startswith(("-", "[REDACTED")):
        return None
    if _FLAG_WORD.fullmatch(before) or _AWS_NAME.fullmatch(before):
        return "[REDACTED:flag]"
    if before in _OPENSSL_PASS and word.startswith("pass:"):
        return "pass:[REDACTED:openssl_pass]"
    http = before in _USER_FLAGS | _COOKIE_FLAGS and command_program(words[:at]) in _HTTP_CLIENTS
    found = (_USER_WORD if before in _USER_FLAGS else _COOKIE_WORD).fullmatch(word) if http else None
    kind = "user_password" if before in _USER_FLAGS else "cookie"
    return None if found is None else f"{found.group(1)}[REDACTED:{kind}]"


class ShellText(str):
    """A text a shell runs (``sh -c``'s script, a command tool's ``command``): a ``Redactor``
    replaces only inside each word the shell reads in it, never across one (``Redactor.shell``).
    It stays one when redacted and cut, so that the log's own pass over an event reads it so too.
    """

    __slots__ = ()


# Why a reader of our own: ``shlex`` gives no positions, knows no ``$(...)`` nor backticks, and
# takes ``#`` and ``;`` for words. A regex cannot tell a quote that opens a value from one that
# closes an earlier string: ``X="PASSWORD="ab rm -rf src""`` runs ``rm``, and the whole-text
# pass recorded ``X="PASSWORD="[REDACTED:quoted_assignment]""``.
_ENDS = frozenset(" \t\n;&|<>()")  # what ends a word that is not quoted: a blank, an operator
# A run of characters no shell ends a word in, whatever the quoting: no blank, operator or
# backtick, and a backslash takes the next character but a newline (what it escapes, or
# inside quotes what is quoted too). Every such run lies inside one word the shell reads.
_RUN = re.compile(r"(?:[^\s;&|<>()`\\]|\\[^\n])+")
# A word whose value is the next word: a credential's flag, openssl's ``-passin``, an HTTP
# scheme, the word password, a name given with ``:`` or ``=>`` (never ``NAME= x``: the shell
# runs ``x``), ``aws configure set``'s secret names; and curl's user and cookies, only in a
# command of curl and its kin (``_HTTP_CLIENTS``).
_VALUE_NEXT = re.compile(
    rf"--?[\w\-]*(?i:{_NAMES})|-pass(?:in|out)?|[Bb]earer|Basic|[Tt]oken|(?i:password|passwd|passphrase)"
    rf"|\S*(?i:{_NAMES})\\?[\"']?(?:=>|:)|(?i:cookie):|{_AWS_NAME.pattern}"
)
_HTTP_VALUE_NEXT = _USER_FLAGS | _COOKIE_FLAGS
# What parts a command from the one before it (``;``, ``&&``, ``|``, a newline, ``$(``, ...).
_COMMAND_ENDS = frozenset(";&|()\n`")
# In a here-document's text (a config file, a script for another language) a name is given its
# value with blanks around too (``PASSWORD = "x"``): a word naming a credential, and ``=``.
_NAME_WORD = re.compile(rf"\S*(?i:{_NAMES})\\?[\"']?")
_GIVES_WORD = frozenset({"=", ":", "=>"})
# And a YAML name's value on the next line, indented (``password:\n  x``, ``token: |\n  x``).
_YAML_GAP = re.compile(r"[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+")
# A private key in a here-document's text, from its BEGIN line to its END line: a piece of its
# own, since its lines are no shell words. Its lines: base64, or a header of words.
_KEY_BLOCK = re.compile(
    r"^[ \t]*-----BEGIN (?P<kind>[A-Z ]*PRIVATE KEY(?: BLOCK)?)-----[ \t]*\r?\n"
    r"(?:[ \t]*(?:[\w\-]+:[ \t][\w .,@+/:=\t\-]*|[A-Za-z0-9+/=]*[ \t]*)\r?\n)*"
    r"[ \t]*-----END (?P=kind)-----",
    re.MULTILINE,
)
_DEEPEST = 3  # here-documents in here-documents: past this, the text is read as runs


_QUOTING = re.compile(r"['\"\\]")
_MARK = re.compile(r"\[REDACTED[^\]]*\]")


# Where a character of a word read as the shell reads it comes from: its span in the word (with
# the backslash that escapes it), and the span of the quotes around it (its own span when none).
_Source = tuple[int, int, tuple[int, int]]


def _unquoted(word: str) -> tuple[str, list[_Source]]:
    """``word`` as the shell reads it, its quotes gone and what they escape kept (``"a"'b'`` is
    ``ab``, bash's ``$'x'`` is ``x``, an unclosed quote runs to the end); and where each of its
    characters comes from."""
    chars: list[str] = []
    sources: list[_Source] = []
    quote, opened, inside, i = "", 0, 0, 0
    while i < len(word):
        char, escaped = word[i], word[i + 1 : i + 2]
        size = (
            2 if char == "\\" and escaped and (quote != "'" and (quote != '"' or escaped in '$`"\\\n')) else 1
        )
        if not quote and word.startswith(("$'", '$"'), i):
            quote, opened, inside, i = word[i : i + 2].replace('$"', '"'), i, len(chars), i + 2
        elif size == 1 and ((not quote and char in "'\"") or (quote and quote[-1] == char)):
            if quote:  # closed: its characters lie inside it
                sources[inside:] = [(a, b, (opened, i + 1)) for a, b, _ in sources[inside:]]
            quote, opened, inside, i = ("" if quote else char), i, len(chars), i + 1
        else:
            chars.append(word[i + size - 1])
            sources.append((i, i + size, (opened, len(word)) if quote else (i, i + size)))
            i += size
    return "".join(chars), sources


def _changed(text: str, redacted: str) -> tuple[int, int]:
    """How many characters at the start and at the end of ``text`` its redaction kept: what
    lies between was replaced (never half a mark: a value may end as a mark does)."""
    start = 0
    most = min(len(text), len(redacted))
    while start < most and text[start] == redacted[start]:
        start += 1
    end = 0
    while end < most - start and text[-1 - end] == redacted[-1 - end]:
        end += 1
    for mark in _MARK.finditer(redacted):
        if mark.start() < start < mark.end():
            start = mark.start()
        if mark.start() < len(redacted) - end < mark.end():
            end = len(redacted) - mark.end()
    return start, end


class _Unread(Exception):
    """A text whose words this reader may not read as the shell does (private: never raised
    out of ``_shell_pieces``)."""


def _shell_pieces(text: str, *, depth: int = 0, data: bool = False) -> list[tuple[int, int]]:
    """The spans of ``text``, a shell's script, that are redacted each alone: each word the
    shell reads (with its quotes), a credential's flag with the word after it, in a word
    holding ``$(...)`` or backticks the parts around them and the words inside, and the text
    of a here-document (``_here_text``). ``data``: ``text`` is a here-document's, where a name
    is also given its value as ``NAME = value``.

    A text this reader may misread (an unclosed quote, ``$'...'`` which bash and dash read
    apart, ``case`` inside ``$(...)``) is cut into runs no shell ends a word in (``_RUN``)
    instead; never the whole text: a shell runs the lines before the one it cannot parse, and a
    value the regexes took past a quote they misread hid them."""
    try:
        segments = _segments(text, 0, nested=False, depth=depth)[0]
    except (_Unread, RecursionError):  # RecursionError: ``$(`` in ``$(`` ... past Python's stack
        segments = [(*match.span(), True) for match in _RUN.finditer(text)]
    return _paired(text, segments, data=data)


def _paired(text: str, segments: list[tuple[int, int, bool]], *, data: bool) -> list[tuple[int, int]]:
    """``segments`` as pieces, a word whose value is the next word (``_VALUE_NEXT``; in a
    here-document's text, a name and ``=``) joined with it when only blanks part them."""
    pieces: list[tuple[int, int]] = []
    programs = _programs(text, segments)
    at = 0
    while at < len(segments):
        start, end, whole = segments[at]
        last = _value_end(text, segments, at, data=data, program=programs[at]) if whole else None
        if last is None:
            pieces.append((start, end))
            at += 1
        else:
            pieces.append((start, segments[last][1]))
            at = last + 1
    return pieces


def _programs(text: str, segments: list[tuple[int, int, bool]]) -> list[str]:
    """For each segment, the program its command runs (``command_program``)."""
    programs: list[str] = []
    program = ""
    for at, (start, end, _) in enumerate(segments):
        if not at or any(char in _COMMAND_ENDS for char in text[segments[at - 1][1] : start]):
            program = ""
        if not program:
            program = command_program((text[start:end],))
        programs.append(program)
    return programs


def _value_end(
    text: str, segments: list[tuple[int, int, bool]], at: int, *, data: bool, program: str
) -> int | None:
    """The index of the value's segment when the one at ``at`` is given the value after it."""
    start, end = segments[at][:2]
    value = at + 1
    if data and value + 1 < len(segments) and _NAME_WORD.fullmatch(text, start, end):
        gives = segments[value]
        if gives[2] and text[gives[0] : gives[1]] in _GIVES_WORD and _blank(text, end, gives[0]):
            value, end = value + 1, gives[1]
    http = program in _HTTP_CLIENTS and text[start:end] in _HTTP_VALUE_NEXT
    if value == at + 1 and not (http or _VALUE_NEXT.fullmatch(text, start, end)):
        return None
    if value >= len(segments):
        return None
    after, _, whole = segments[value]
    gap = _blank(text, end, after) or (
        data and text[end - 1] == ":" and _YAML_GAP.fullmatch(text, end, after)
    )
    return value if whole and gap and text[after] != "-" else None


def _blank(text: str, start: int, end: int) -> bool:
    return not text[start:end].strip(" \t")


def _segments(text: str, i: int, *, nested: bool, depth: int) -> tuple[list[tuple[int, int, bool]], int]:
    """``(start, end, whole)`` of the words from ``i`` (``whole``: a word with no substitution
    in it), up to the end, or when ``nested`` up to the ``)`` that closes a ``$(``; and where
    that stopped. A here-document's text is read at the end of the line that gave it."""
    out: list[tuple[int, int, bool]] = []
    here: list[tuple[str, bool, bool]] = []  # the here-documents whose text the next line begins
    parens = 0
    while i < len(text):
        char = text[i]
        if char == "#":  # a comment, to the end of its line: not run, but it may hold a secret
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            out.append((i, end, False))
            i = end
            continue
        if char not in _ENDS:
            start = i
            i = _word(text, i, out, depth)
            if here and "\n" in text[start:i]:  # the text begins inside the word: not read
                raise _Unread
            if nested and text[start:i] == "case":  # its patterns end in a ")" of their own
                raise _Unread
            continue
        if char == "<" or (char == "\n" and here):
            i = _here(text, i, out, here, depth)
            continue
        if char == "(":
            parens += 1
        elif char == ")":
            if nested and parens == 0:
                if here:  # its text would be read after the ")"
                    raise _Unread
                return out, i + 1
            parens -= 1
        i += 1
    if nested:
        raise _Unread
    return out, i


def _here(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads a here-document's ``<<`` and word at ``i``, or at a line's end the texts of those
    its line gave; past a ``<`` or a here-string's ``<<<`` otherwise."""
    if text[i] == "\n":
        return _here_text(text, i + 1, out, here, depth)
    if text.startswith("<<<", i):  # a here-string: its word follows, on its line
        return i + 3
    if text.startswith("<<", i):
        return _here_word(text, i, out, here, depth)
    return i + 1


def _here_word(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads the ``<<`` (or ``<<-``) at ``i`` and the word after it, which ends the here-document
    (quoted: its text is the shell's to read as it is); where that word ends."""
    i += 2
    tabs = text.startswith("-", i)
    i += tabs
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] in _ENDS:
        raise _Unread
    start, words = i, list[tuple[int, int, bool]]()
    i = _word(text, i, words, depth)
    if len(words) != 1 or not words[0][2]:  # a substitution in it: the shells differ
        raise _Unread
    written = text[start:i]
    delimiter = re.sub(r"\\(.)|['\"]", lambda match: match.group(1) or "", written)
    out.extend(words)
    here.append((delimiter, tabs, delimiter != written))
    return i


def _here_text(
    text: str, i: int, out: list[tuple[int, int, bool]], here: list[tuple[str, bool, bool]], depth: int
) -> int:
    """Reads the texts of ``here``'s documents, the first from ``i``, each up to the line that
    is its word (``<<-``: after its tabs), or to the end of ``text``; where they end."""
    for delimiter, tabs, quoted in here:
        start = end = i
        while i < len(text):
            eol = text.find("\n", i)
            eol = len(text) if eol < 0 else eol
            line = text[i:eol]
            end, i = i, eol + 1
            if (line.lstrip("\t") if tabs else line) == delimiter:
                break
            if not quoted and line.endswith("\\"):  # joined to the next line: the shells differ
                raise _Unread
        else:
            end = len(text)
        if depth >= _DEEPEST:
            raise _Unread
        out.extend((a, b, False) for a, b in _document(text, start, end, depth + 1))
    here.clear()
    return min(i, len(text))


def _document(text: str, start: int, end: int, depth: int) -> list[tuple[int, int]]:
    """The pieces of a here-document's text, ``text[start:end]``: what a program reads (a
    config file, a script, a key), whose words hold its values; and each private key whole.

    Read word by word as a script (``_shell_pieces``): a value never takes in what follows its
    word, whatever the program makes of it, since it may be a shell (``sh <<EOF``)."""
    pieces: list[tuple[int, int]] = []
    at = start
    for key in _KEY_BLOCK.finditer(text, start, end):
        pieces += [(at + a, at + b) for a, b in _shell_pieces(text[at : key.start()], depth=depth, data=True)]
        pieces.append(key.span())
        at = key.end()
    pieces += [(at + a, at + b) for a, b in _shell_pieces(text[at:end], depth=depth, data=True)]
    return pieces


def _word(text: str, i: int, out: list[tuple[int, int, bool]], depth: int) -> int:
    """Reads the word at ``i`` into ``out``; where it ends."""
    start = part = i
    whole, quoted = True, False  # quoted: inside "..."
    while i < len(text):
        char = text[i]
        if not quoted and char in _ENDS:
            break
        if char == "\\":
            i += 2
        elif char == "'" and not quoted:
            end = text.find("'", i + 1)
            if end < 0 or text.startswith("$'", i - 1):
                raise _Unread
            i = end + 1
        elif char == '"':
            quoted, i = not quoted, i + 1
        elif text.startswith("$(", i) or char == "`":
            if part < i:
                out.append((part, i, False))
            whole = False
            i = _backticks(text, i, out, quoted=quoted) if char == "`" else _nested(text, i + 2, out, depth)
            part = i
        else:
            i += 1
    if quoted:
        raise _Unread
    i = min(i, len(text))
    if part < i:
        out.append((start if whole else part, i, whole))
    return i


def _nested(text: str, i: int, out: list[tuple[int, int, bool]], depth: int) -> int:
    """Reads the words of the ``$(...)`` whose script starts at ``i``; where it ends."""
    inner, end = _segments(text, i, nested=True, depth=depth)
    out.extend(inner)
    return end


def _backticks(text: str, i: int, out: list[tuple[int, int, bool]], *, quoted: bool) -> int:
    """Reads the command in the backticks at ``i`` as runs (``_RUN``); where it ends. Inside
    double quotes, the shells read quotes in it apart: such a text is not read."""
    end = i + 1
    while end < len(text) and text[end] != "`":
        end += 2 if text[end] == "\\" else 1
    if end >= len(text) or (quoted and any(q in text[i + 1 : end] for q in "'\"")):
        raise _Unread
    out.extend((*match.span(), False) for match in _RUN.finditer(text, i + 1, end))
    return end + 1


class CodeText(str):
    """A program's source in a language other than a shell's (``run_code``'s Python, node,
    ...): a ``Redactor`` replaces only inside each of its statements (``Redactor.code``), so
    that a value never runs past the quote that closes its string (``P = "--password ";
    os.rmdir(...)`` was recorded as ``P = "--password "[REDACTED:flag]"...``). It stays one when
    redacted and cut, as ``ShellText`` does."""

    __slots__ = ()


# A key's lines in code: one piece, redacted whole (OpenPGP's armor too).
_CODE_KEY_BLOCK = re.compile(f"{TOKEN_PATTERNS['private_key']}|{TOKEN_PATTERNS['pgp_private_key']}")
_GIVEN = re.compile(rf"[ \t]*{_GIVES}")  # after a string, a value given to it (a key: ``"password":``)
_QUOTES = "'\"`"
_TRIPLES = ('"""', "'''")
# A credential's name right before where a value is given to it in code (what is looked back
# over: a name's end, then blanks and the quote that closes a key's string).
_CODE_NAME = re.compile(rf"(?i:{_NAMES})['\"]?[ \t]*\Z")
_NAME_REACH = 32
# What a value given in code begins with, after blanks and a ``(``: a string (a literal, which
# is the value) or a name (an expression: ``password = os.system``, whose call is no secret).
_CODE_VALUE = re.compile(r"[ \t]*(?:\([ \t]*)?(?:(?P<quote>\"\"\"|'''|['\"`])|[A-Za-z_$])")
_CODE_REDACTED = "[REDACTED:quoted_assignment]"  # a string literal given to a credential's name
# A code piece: its span, and whether it is a string literal given to a credential's name
# (its text between its quotes is replaced whole: ``\'`` and ``;`` in it are its own).
_CodePiece = tuple[int, int, bool]
_Piece = tuple[int, int] | _CodePiece


def _code_pieces(text: str) -> list[_CodePiece]:
    """The spans of ``text``, a program's source, that are redacted each alone: each private
    key block, and elsewhere each line cut at a ``;`` outside a string and right after the
    quote that closes a string (but a key's: ``"token": "x"`` is one piece); a string given to
    a credential's name is a piece of its own, and what a name is given that is no string (an
    expression) begins one."""
    pieces: list[_CodePiece] = []
    at = 0
    for key in _CODE_KEY_BLOCK.finditer(text):
        pieces += _statements(text, at, key.start())
        pieces.append((*key.span(), False))
        at = key.end()
    return pieces + _statements(text, at, len(text))


def _statements(text: str, start: int, end: int) -> list[_CodePiece]:
    """The pieces of ``text[start:end]`` (see ``_code_pieces``). Strings are read as most
    languages write them (``'``, ``"``, a backtick or Python's triple quotes, a backslash
    escaping the next character, none but a triple-quoted one running past its line): a
    language that reads them otherwise gets pieces cut at other quotes, never a value longer
    than a line but a triple-quoted string's that is given to a credential's name."""
    pieces: list[_CodePiece] = []
    piece = i = start
    quote = ""
    unclosed: dict[str, int] = {}  # a triple quote: from where none closes one (read once)
    while i < end:
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if not quote and char in "=:" and (given := _given_at(text, piece, i, end)) is not None:
            value, literal_end = given
            if value > piece:
                pieces.append((piece, value, False))
            if literal_end is not None:
                pieces.append((value, literal_end, True))
            piece = i = literal_end if literal_end is not None else value
            continue
        if char == "\n" and quote not in _TRIPLES:
            pieces.append((piece, i, False))
            piece, quote = i + 1, ""
        elif char == "\n" or (char == ";" and not quote):
            pieces.append((piece, i, False))
            piece = i + 1
        elif quote and text.startswith(quote, i):
            i += len(quote) - 1
            quote = ""
            if not _GIVEN.match(text, i + 1, end):
                pieces.append((piece, i + 1, False))
                piece = i + 1
        elif not quote and char in _QUOTES:
            quote = _opening(text, i, end, unclosed)
            i += len(quote) - 1
        i += 1
    pieces.append((piece, end, False))
    return [(a, b, literal) for a, b, literal in pieces if a < b]


def _opening(text: str, i: int, end: int, unclosed: dict[str, int]) -> str:
    """The quote that opens a string at ``i``: a triple one only when one closes it."""
    for triple in _TRIPLES:
        if text.startswith(triple, i) and i + 3 < unclosed.get(triple, end + 1):
            if text.find(triple, i + 3, end) >= 0:
                return triple
            unclosed[triple] = i + 3
    return text[i]


def _given_at(text: str, piece: int, i: int, end: int) -> tuple[int, int | None] | None:
    """At ``i``, outside a string, a ``=`` or ``:`` that gives a credential's name a value:
    where that value begins, and where it ends when it is a string literal (its closing quote
    on its line, but a triple quote's; no longer than a credential). ``None``: none is given
    there, or a value that is neither (a number, a list: read as the patterns read it)."""
    gives = _GIVES_AT.match(text, i, end)
    if gives is None or (i > piece and text[i - 1] in "=!<>"):
        return None
    if _CODE_NAME.search(text, max(piece, i - _NAME_REACH), i) is None:
        return None
    value = _CODE_VALUE.match(text, gives.end(), end)
    if value is None:
        return None
    quote = value.group("quote")
    if quote is None:  # an expression: kept, but for a token's shape the patterns find in it
        return value.end() - 1, None
    close = _closing(text, value.end(), end, quote)
    if close is None:
        return None
    return value.end() - len(quote), close + len(quote)


_GIVES_AT = re.compile(_GIVES)


def _literal_redacted(literal: str) -> str:
    """A string literal given to a credential's name (with its quotes), its text replaced;
    one too short to be a credential, or a mark already, stays."""
    quote = literal[:3] if literal.startswith(_TRIPLES) else literal[0]
    inside = literal[len(quote) : len(literal) - len(quote)]
    if len(inside) < MIN_SECRET_LENGTH or inside.startswith("[REDACTED"):
        return literal
    return f"{quote}{_CODE_REDACTED}{quote}"


def _closing(text: str, i: int, end: int, quote: str) -> int | None:
    """Where the string whose text starts at ``i`` closes, within ``_LONGEST`` characters (and
    its line, but a triple quote's); ``None``: not there."""
    last = min(end, i + _LONGEST + 1)
    while i < last:
        if text[i] == "\\":
            i += 2
        elif text.startswith(quote, i):
            return i
        elif text[i] == "\n" and quote not in _TRIPLES:
            return None
        else:
            i += 1
    return None


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
_PERSONAL = _compile(PERSONAL_DATA_PATTERNS)
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
# name -> the characters a tail pattern's whole match is made of: it lies in the last run of
# them, and is searched for there. From the text's start, each of its starts in an earlier run
# (every ``sk-`` of ``sk-sk-…sk-!``) was a scan to that run's end: a time quadratic in the run.
_WORD_CHARS = string.ascii_letters + string.digits + "_"
_TAIL_RUNS = {
    "api_key": _WORD_CHARS + "-",
    "github_token": _WORD_CHARS,
    "slack_token": _WORD_CHARS + "-",
    "stripe_key": _WORD_CHARS,
    "gitlab_token": _WORD_CHARS + "-",
    "huggingface_token": _WORD_CHARS,
    "npm_token": _WORD_CHARS,
    "jwt": _WORD_CHARS + "-.",
    "email": _WORD_CHARS + ".%+-@",
    "number": string.digits + " .-()+",
    "iban": string.ascii_uppercase + string.digits + " ",
    "ipv6": string.hexdigits + ":",
}
# Other tail patterns are searched for in the text's last characters: one starting before them
# holds a value longer than a complete match needs, which the whole-text patterns replace.
_TAIL_WINDOW = 2 * _LONGEST
_Tail = tuple[re.Pattern[str], str | None]
_TAILS: list[_Tail] = [(pattern, _TAIL_RUNS.get(name)) for name, pattern in _compile(TAIL_PATTERNS)]
_PERSONAL_TAILS: list[_Tail] = [
    (pattern, _TAIL_RUNS.get(name)) for name, pattern in _compile(PERSONAL_TAIL_PATTERNS)
]


def _tail_start(text: str, patterns: Sequence[_Tail]) -> int:
    """Where the earliest of ``patterns`` begins a match that runs to the end of ``text`` (its
    ``keep`` group stays); ``len(text)`` when none does."""
    start = len(text)
    for pattern, run in patterns:
        at = len(text.rstrip(run)) if run is not None else len(text) - _TAIL_WINDOW
        match = pattern.search(text, max(at, 0))
        if match is not None:
            start = min(start, match.end("keep") if "keep" in pattern.groupindex else match.start())
    return start


def redact_personal_data(text: str) -> str:
    """Replace what looks like personal data by ``[REDACTED:<kind>]`` (see the module's doc)."""
    if not _ANY_PERSONAL.search(text):
        return text
    for pattern, replace in _PERSONAL_REPLACERS:
        text = pattern.sub(replace, text)
    return text


class SecretValues:
    """Registered secret values, replaced wherever they occur. Thread-safe."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()
        for value in values:
            self.add(value)

    def add(self, value: str) -> None:
        if len(value) < MIN_SECRET_LENGTH:
            raise exc.ConfigurationError(
                f"a secret shorter than {MIN_SECRET_LENGTH} characters would redact ordinary text"
            )
        with self._lock:
            self._values.add(value)
            # Longest first, so that a secret containing another is replaced whole.
            ordered = sorted(self._values, key=len, reverse=True)
            self._pattern = re.compile("|".join(re.escape(v) for v in ordered))

    def __len__(self) -> int:
        return len(self._values)

    def prefix_at_end(self, text: str) -> int:
        """How many characters at the end of ``text`` are the beginning of a registered secret
        (the longest such): what a cut there may have kept of one."""
        with self._lock:
            values = tuple(self._values)
        longest = 0
        for value in values:
            for size in range(min(len(value) - 1, len(text)), longest, -1):
                if text.endswith(value[:size]):
                    longest = size
                    break
        return longest

    def suffix_at_start(self, text: str) -> int:
        """How many characters at the start of ``text`` are the end of a registered secret (the
        longest such): what a cut there may have kept of one."""
        with self._lock:
            values = tuple(self._values)
        longest = 0
        for value in values:
            for size in range(min(len(value) - 1, len(text)), longest, -1):
                if text.startswith(value[-size:]):
                    longest = size
                    break
        return longest

    def __call__(self, text: str) -> str:
        pattern = self._pattern
        if pattern is None:
            return text
        return pattern.sub("[REDACTED:secret]", text)


class Redactor:
    """The redaction pipeline shared by the audit log, the JSON logs and the spans.

    ``Redactor()`` runs registered secrets then ``redact_tokens`` (then ``redact_personal_data``
    with ``personal_data=True``); pass ``processors`` to choose the pipeline (``redactor.secrets``
    is always available to put in it). Processors must be pure: results for short strings (keys,
    names, ids) are cached, and the cache is dropped whenever a secret is registered.
    """

    def __init__(
        self, processors: Sequence[StringProcessor] | None = None, *, personal_data: bool = False
    ) -> None:
        self.secrets = SecretValues()
        default: tuple[StringProcessor, ...] = (self.secrets, redact_tokens)
        if personal_data:
            default += (redact_personal_data,)
        self.processors: tuple[StringProcessor, ...] = default if processors is None else tuple(processors)
        self._cache: dict[str, str] = {}
        self._cached_secrets = 0
        self._long: dict[str, str] | None = None  # see ``remembering``
        self._long_chars = 0
        self._long_budget = 0

    @property
    def redacts_personal_data(self) -> bool:
        return redact_personal_data in self.processors

    def add_secret(self, value: str) -> None:
        """Never write ``value``, wherever it appears (e.g. a token passed to a sandbox's env)."""
        self.secrets.add(value)

    def add_secrets(self, values: Iterable[str]) -> None:
        for value in values:
            self.secrets.add(value)

    def remembering(self, *, max_chars: int = 4 * 1024 * 1024) -> Redactor:
        """The same pipeline and secrets, also remembering the results for long strings, up to
        ``max_chars`` characters of them (then it starts afresh).

        For a writer that sees the same long text again and again: a run store writes each
        observation in the tool-call message, the step record and the ledger, and an agent
        reads the same file many times. Registering a secret on either redactor forgets
        everything remembered.
        """
        twin = Redactor(self.processors)
        twin.secrets = self.secrets
        twin._long = {}
        twin._long_budget = max_chars
        return twin

    def text(self, text: str) -> str:
        if isinstance(text, ShellText):
            return self.shell(text)
        if isinstance(text, CodeText):
            return self.code(text)
        if "characters cut" in text and CUT_MARK.search(text):
            return self._across_cuts(text)
        return self._text(text)

    def shell(self, text: str, *, was_cut: bool = False) -> ShellText:
        """``text``, a shell's script, redacted word by word (``_shell_pieces``): a value ends
        where the shell ends its word, whatever quote a regex would have read it to.
        ``was_cut``: ``text`` ends where someone cut it (``head``)."""
        return ShellText(self._by_pieces(text, _shell_pieces, was_cut=was_cut))

    def code(self, text: str, *, was_cut: bool = False) -> CodeText:
        """``text``, a program's source (``CodeText``), redacted statement by statement
        (``_code_pieces``): a value ends at the end of its line, at a ``;`` and at the quote
        that closes its string, whatever quote a regex would have read it to. A string given
        to a credential's name is hidden whole (Python's triple quotes, ``= ("x")``, ``'a\\'b'``);
        an expression given to one (``password = os.system``) is code, and is kept."""
        return CodeText(self._by_pieces(text, _code_pieces, was_cut=was_cut))

    def _by_pieces(self, text: str, pieces: Callable[[str], Sequence[_Piece]], *, was_cut: bool) -> str:
        """``text`` with each of its ``pieces`` redacted alone; a registered secret is replaced
        wherever it is first: it is the caller's own value, and hides nothing but itself."""
        if self.secrets in self.processors:
            text = self.secrets(text)
        out: list[str] = []
        done = 0
        for start, end, *literal in pieces(text):
            piece = text[start:end]
            if literal and literal[0] and redact_tokens in self.processors:
                redacted = _literal_redacted(piece)
            elif was_cut and end == len(text):
                redacted = self.head(piece)
            else:
                redacted = self._word(piece)
            out += [text[done:start], redacted]
            done = end
        out.append(text[done:])
        return "".join(out)

    def _word(self, piece: str) -> str:
        """``piece``, a shell's word (or a flag and its value), redacted; and as the shell reads
        it too, its quotes removed (``PASSWORD=""x``, ``PASSWORD="a"'b'``, ``$'x'``: the parts
        of one value), what that hides put in place of the characters it came from."""
        out = self._text(piece)
        if not _QUOTING.search(piece):
            return out
        joined, sources = _unquoted(piece)
        hidden = self._text(joined)
        if hidden == joined:
            return out
        start, end = _changed(joined, hidden)
        if start + end >= len(joined):  # nothing of the word replaced: something added
            return self._text(hidden)
        first, last = sources[start], sources[len(joined) - end - 1]
        if first[2] != last[2]:  # not inside one quote: the quotes it spans go too
            first, last = (*first[2], first[2]), (*last[2], last[2])
        # then the patterns once more: what they found in the word as written stays hidden too
        return self._text(piece[: first[0]] + hidden[start : len(hidden) - end] + piece[last[1] :])

    def _across_cuts(self, text: str) -> str:
        """``text`` whose middle was cut (``cut_marker``), redacted piece by piece: what ends at
        a mark as ``head`` does, what starts after one without what may end a secret there."""
        out: list[str] = []
        start = 0
        for mark in CUT_MARK.finditer(text):
            out.append(self._piece(text[start : mark.start()], after_cut=start > 0, before_cut=True))
            out.append(self._text(mark.group()))  # code's output may spell a mark of its own
            start = mark.end()
        out.append(self._piece(text[start:], after_cut=True, before_cut=False))
        return "".join(out)

    def _piece(self, text: str, *, after_cut: bool, before_cut: bool) -> str:
        lead = self._lead(text) if after_cut else 0
        rest = text[lead:]
        return (CUT_REDACTED if lead else "") + (self.head(rest) if before_cut else self._text(rest))

    def _lead(self, text: str) -> int:
        """How many characters at the start of ``text`` (which a cut began) may be the end of a
        registered secret or of a credential."""
        end = self.secrets.suffix_at_start(text) if self.secrets in self.processors else 0
        for processor, lead in ((redact_tokens, _LEAD), (redact_personal_data, _PERSONAL_LEAD)):
            match = lead.match(text) if processor in self.processors else None
            end = max(end, match.end() if match is not None else 0)
        return end

    def _text(self, text: str) -> str:
        if self._cached_secrets != len(self.secrets):
            self._cache.clear()
            if self._long is not None:
                self._long.clear()
                self._long_chars = 0
            self._cached_secrets = len(self.secrets)
        short = len(text) <= CACHED_LENGTH
        if short:
            cached = self._cache.get(text)
            if cached is not None:
                return cached
        elif self._long is not None:
            cached = self._long.get(text)
            if cached is not None:
                return cached
        out = text
        for processor in self.processors:
            out = processor(out)
        if short:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[text] = out
        elif self._long is not None and len(text) <= self._long_budget:
            if self._long_chars + len(text) > self._long_budget:
                self._long.clear()
                self._long_chars = 0
            self._long[text] = out
            self._long_chars += len(text)
        return out

    def cut(self, text: str, cap: int, *, was_cut: bool = False) -> str:
        """``text`` redacted, then cut to ``cap`` characters (saying how many more there were).
        In that order: a cut first can keep a credential's prefix that no pattern knows.
        ``was_cut``: someone already cut ``text`` at its end before it came here (``head``)."""
        if isinstance(text, ShellText):
            out: str = self.shell(text, was_cut=was_cut)
        elif isinstance(text, CodeText):
            out = self.code(text, was_cut=was_cut)
        else:
            out = self.head(text) if was_cut else self.text(text)
        if len(out) <= cap:
            return out
        kept = out[:cap] + f"…[{len(out) - cap} more chars]"
        return type(text)(kept) if isinstance(text, ShellText | CodeText) else kept

    def head(self, text: str) -> str:
        """``text`` redacted, where ``text`` is the head of a longer one that was cut before
        it came here (a sandbox's capped word, a proxy's shortened path): what at its end may
        be the beginning of a registered secret or of a credential-shaped match that the cut
        ended is replaced by ``[REDACTED:cut]`` too, since no pattern matches half a token."""
        held = ""
        for _ in range(_HEAD_ROUNDS):
            start = self._tail(text)
            if start == len(text):
                return self._text(text) + held
            # held back from there; and what is left ends at a cut too (a secret holding a
            # credential's shape may have begun before it): looked at again
            text, held = text[:start], CUT_REDACTED
        return CUT_REDACTED  # still more: nothing is kept rather than too much

    def _tail(self, text: str) -> int:
        """Where what may be the beginning of a secret or a match at the end of ``text`` starts."""
        start = len(text)
        if self.secrets in self.processors:
            start -= self.secrets.prefix_at_end(text)
        if redact_tokens in self.processors:
            start = min(start, _tail_start(text, _TAILS))
        if redact_personal_data in self.processors:
            start = min(start, _tail_start(text, _PERSONAL_TAILS))
        return start

    def value(self, value: object) -> JSONValue:
        """``value`` as JSON, with every string redacted. Unknown objects become their ``str``."""
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            # JSON writes no integer past 4,300 digits (CPython's limit), and readers of the
            # trail take 64 bits: a larger one is said, not written (it failed every later flush)
            return value if -(2**63) <= value < 2**63 else f"<an integer of {value.bit_length()} bits>"
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, Mapping):
            return self.attributes(value)
        if isinstance(value, list | tuple | set | frozenset):
            items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
            return [self.value(item) for item in items]
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        return self.text(str(value))

    def attributes(self, attributes: Mapping[Any, object]) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {}
        for key, item in attributes.items():
            name = self.text(str(key))
            if _held(item) and _sensitive_key(name):
                out[name] = REDACTED  # whatever it is: a string, a number, a list, an object
            elif name in _PATH_MAPS and isinstance(item, Mapping):
                out[name] = {self.text(str(path)): self.value(content) for path, content in item.items()}
            else:
                out[name] = self.value(item)
        return out

    def structlog_processor(self, logger: object, method: str, event_dict: Any) -> Any:
        """The same redaction as a structlog processor (put it before the renderer)."""
        return self.attributes(event_dict)
