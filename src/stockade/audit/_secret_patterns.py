"""The shapes of credentials: the regular expressions ``redact_tokens`` replaces, and those of
what a cut may have kept of one (``TAIL_PATTERNS``), beside each other so that a shape and its
head change together; with the parts they are written from (a name that holds a credential,
what ends a shell's word, a quoted value's character), which the readers of a command and of
code share. Plain data and one pass over a text: nothing here reads a command's words.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

__all__ = [
    "GIVES",
    "LONGEST",
    "NAMES",
    "SECRET_KEYS",
    "SHELL",
    "TAIL_PATTERNS",
    "TOKEN_PATTERNS",
    "compile_patterns",
    "redact_tokens",
]

# What a name that holds a credential ends with, in text (``PGPASSWORD=``, ``"accessToken":``,
# ``db_pass=``; a bare ``pass`` is a word too often: ``bypass``, ``compass``).
# ``SECRET_KEY=``, ``PRIVATE_KEY=``, ``OPENAI_KEY=``: a key of a kind that is secret, or of a
# service whose keys are (``SECRET_KEYS``); not a bare ``key`` (``sort_key``, ``cache_key``,
# ``primary_key``, ``public_key``).
SECRET_KEYS = (
    "secret|private|signing|encryption|master|account|app|auth|subscription"
    "|openai|anthropic|azure|stripe|sendgrid|mailgun|twilio"
)
NAMES = (
    r"passwords?|passwd|passphrase|secret|token|api[_\-]?key|access[_\-]?key|[_.\-]pass"
    rf"|(?:{SECRET_KEYS})[_\-]?key"
)
# The name before a value, from the start of its run of name characters (``db.password``,
# ``x-api-key``): written ``\b[\w.\-]*``, a match was tried from every word boundary of a run, each
# a scan to its end (``a.a.a.…`` took minutes); from the run's start only, once per run.
_NAMED = rf"(?<![\w.\-])[\w.\-]*(?i:{NAMES})"
# What ends a value that is not quoted: besides a space or a quote, what a shell reads as the
# end of a word (``;`` ``&`` ``|`` ``<`` ``>`` ``(`` ``)``) or the start of an expansion (``$``,
# a backtick). A value ran through them: ``--token x;rm -rf src`` hid the ``rm`` in the trail.
# Tokens, URL-encoded and base64 secrets hold none of them.
SHELL = r";&|<>$()`"
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
_BARE = rf"(?:[^\s\"'\\{SHELL}]|\\[^\n])"
# A quoted value longer than this is no credential: a value stops being read past it (a longer
# token has no space, and the patterns of unquoted values take it whole).
LONGEST = 256
# How a value is given to a name: ``=``, ``:``, and ``=>`` (Perl, PHP, Ruby); not ``==``.
GIVES = r"(?:=>|[=:](?![=>]))"
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
_ASSIGNED = rf"(?(opened)(?:[^\s\"',\\{SHELL}]|\\(?![\"']))|(?!,){_BARE})"
# A JSON string's character: no quote, newline or backslash, but one of JSON's escapes.
_JSON = rf"(?:{_QUOTED}|\\(?:[\"\\/bfnrt]|u[0-9A-Fa-f]{{4}}))"

# A cookie's name and value, and what gives them: an HTTP header, curl's flag.
_COOKIE_NAME = rf"[^\s=;'\"\\{SHELL}]{{1,256}}"
_COOKIE_VALUE = rf"(?:(?!,){_BARE})"
_COOKIE_OPENS = r"(?:\b(?i:cookie)[ \t]*:[ \t]*|(?<![\w\-])(?:-b|--cookie)(?:[ \t]+|=)['\"]?)"
# A signed URL's signature parameter (Azure's SAS, AWS's and Google's presigned URLs).
_SIGNATURE_PARAM = r"[?&;](?:sig|[Ss]ignature|(?i:x-(?:amz|goog)-signature))="
# A character of an XML element's text that may be a credential's: none that ends a shell's
# word, but the escapes XML writes them as.
_XML_VALUE = rf"(?:[^\s<>'\"\\{SHELL}]|&(?:amp|lt|gt|quot|apos|#x?[0-9A-Fa-f]{{1,6}});)"
# curl's user flag: ``-u x``, ``-ux`` (a user that begins with a letter), ``--user x``, ``--user=x``.
_USER_OPENS = r"(?<![\w\-])(?:-u(?:[ \t]+|(?=[A-Za-z]))|--user(?:[ \t]+|=))"
# Its user, up to the ``:``: a bounded run, since a user is short and from every ``--user=`` of
# ``--user=--user=…`` an unbounded one scanned to the text's end for a ``:`` (quadratic).
_USER = rf"[^\s:'\"{SHELL}]{{1,{LONGEST}}}"

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
        rf"{_COOKIE_VALUE}{{0,{LONGEST}}}(?:;[ \t]?{_COOKIE_NAME}={_COOKIE_VALUE}{{0,{LONGEST}}}){{0,64}}"
    ),
    # Authorization: Digest ..., response="6629fae4..." (what a password and a nonce hash to)
    "digest_response": r"(?P<keep>response=(?<!\wresponse=)\"?)[0-9a-fA-F]{32,128}(?![0-9A-Za-z])",
    # ?sv=...&sig=x (Azure SAS), X-Amz-Signature=x, X-Goog-Signature=x: a signed URL's signature
    "url_signature": rf"(?P<keep>{_SIGNATURE_PARAM})(?!\[REDACTED)[^\s#'\"\\{SHELL}]{{4,}}",
    # <password>x</password>, <SecretAccessKey>x</SecretAccessKey> (XML: AWS STS answers so);
    # what XML escapes (``&amp;``) the value holds as it
    "xml_element": (
        rf"(?P<keep><(?P<tag>[\w.:\-]{{0,128}}(?i:{NAMES}))>)(?!\[REDACTED)"
        rf"{_XML_VALUE}{{1,{LONGEST}}}(?=</(?P=tag)>)"
    ),
    # openssl ... -passin pass:x (-passout, -pass); its env:NAME, file:path are no secrets
    "openssl_pass": (
        rf"(?P<keep>(?<![\w\-])-pass(?:in|out)?[ \t]+(?P<q>['\"])?pass:)(?!\[REDACTED)"
        rf"(?(q){_QUOTED}|{_BARE}){{1,{LONGEST}}}"
    ),
    # aws configure set aws_secret_access_key x (a value after a space)
    "aws_configure": (
        rf"(?P<keep>\b(?i:aws_(?:secret_access_key|session_token))[ \t]+['\"]?)(?![\-\[=])"
        rf"(?:(?<='){_SQ}{{4,{LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{LONGEST}}}(?=\")|(?<!['\"]){_BARE}{{4,}})"
    ),
    # password:\n  x, token: |\n  x (YAML: the value on the next line, indented; a mapping's key
    # there, ``user: x``, a list's ``- x`` or a comment is none)
    "yaml_next_line": (
        rf"(?P<keep>(?i:{NAMES})[ \t]*:[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+['\"]?)"
        rf"(?![\-\[#{{]|[^\s:'\"]{{0,256}}:(?:\s|\Z))(?!\[REDACTED)(?:(?!,){_BARE}){{4,}}"
    ),
    # "password": "x y" (JSON, its value up to the closing quote, spaces and escapes included)
    "json_assignment": (
        rf"(?P<keep>\"[\w.\-]*(?i:{NAMES})\"[ \t]*:[ \t]*\")(?!\[REDACTED){_JSON}{{4,{LONGEST}}}(?=\")"
    ),
    # passphrase='open sesame', TOKEN="a b c", password => 'x': a quoted value, up to its quote
    "quoted_assignment": (
        rf"(?P<keep>{_NAMED}[ \t]*{GIVES}[ \t]*['\"])(?!\[REDACTED)"
        rf"(?:(?<='){_SQ}{{4,{LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{LONGEST}}}(?=\"))"
    ),
    # https://user:password@host, redis://:password@host: the password of a URL's user information
    # (a user that is a mark already, "[REDACTED:github_token]", is no user and password)
    "url_password": (
        r"(?P<keep>(?<=[A-Za-z0-9+.\-])://(?!\[REDACTED)[^\s/:@'\"]*:)(?!\[REDACTED)"
        rf"[^\s/@'\"{SHELL}]+(?=@)"
    ),
    # --password hunter2, --api-key abcd (a command's flag, its value after a space)
    "flag": (
        rf"(?P<keep>(?<![\w\-])--?[\w\-]*(?i:{NAMES})[ \t]+['\"]?)(?![\-\[])"
        rf"(?:(?<='){_SQ}{{4,{LONGEST}}}(?=')|(?<=\"){_DQ}{{4,{LONGEST}}}(?=\")|(?<!['\"]){_BARE}{{4,}})"
    ),
    # curl -u user:password, --user=user:password, -uuser:password (a user that is a number,
    # docker's -u 1000:1000, is a uid and gid)
    "user_password": (
        rf"(?P<keep>{_USER_OPENS}['\"]?{_USER}:)"
        rf"(?!\[REDACTED|\d+(?![^\s\"'{SHELL}])){_BARE}+"
    ),
    # password=x, PGPASSWORD=x, accessToken: x, 'secret': 'x', \"token\": \"x\" (JSON in a string)
    "assignment": (
        rf"(?P<keep>{_NAMED}(?:\\?[\"'])?[ \t]*{GIVES}[ \t]*(?P<opened>\\?[\"'])?)"
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
    "url_signature": rf"(?P<keep>{_SIGNATURE_PARAM})(?!\[REDACTED)[^\s#'\"\\{SHELL}]*\Z",
    "xml_element": (
        rf"(?P<keep><[\w.:\-]{{0,128}}(?i:{NAMES})>)(?!\[REDACTED)(?:{_XML_VALUE}|&[#\w]{{0,8}}\Z)*\Z"
    ),
    "openssl_pass": (
        rf"(?P<keep>(?<![\w\-])-pass(?:in|out)?[ \t]+(?P<q>['\"])?pass:)(?!\[REDACTED)"
        rf"(?(q){_QUOTED}|{_BARE})*\\?\Z"
    ),
    "aws_configure": (
        rf"(?P<keep>\b(?i:aws_(?:secret_access_key|session_token))[ \t]+['\"]?)(?![\-\[=])"
        rf"(?:(?<='){_SQ}{{0,{LONGEST}}}|(?<=\"){_DQ}{{0,{LONGEST}}}\\?|(?<!['\"]){_BARE}*\\?)\Z"
    ),
    "yaml_next_line": (
        rf"(?P<keep>(?i:{NAMES})[ \t]*:[ \t]*(?:[|>][+\-]?[1-9]?[ \t]*)?\r?\n[ \t]+['\"]?)"
        rf"(?![\-\[#{{]|[^\s:'\"]{{0,256}}:(?:\s|\Z))(?!\[REDACTED){_BARE}*\\?\Z"
    ),
    "json_assignment": (
        rf"(?P<keep>\"[\w.\-]*(?i:{NAMES})\"[ \t]*:[ \t]*\")(?!\[REDACTED)"
        rf"{_JSON}{{0,{LONGEST}}}(?:\\(?:u[0-9A-Fa-f]{{0,3}})?)?\Z"
    ),
    "quoted_assignment": (
        rf"(?P<keep>{_NAMED}[ \t]*{GIVES}[ \t]*['\"])(?!\[REDACTED)"
        rf"(?:(?<='){_SQ}{{0,{LONGEST}}}|(?<=\"){_DQ}{{0,{LONGEST}}}\\?)\Z"
    ),
    "url_password": (
        r"(?P<keep>(?<=[A-Za-z0-9+.\-])://(?!\[REDACTED)[^\s/:@'\"]*:)(?!\[REDACTED)"
        rf"[^\s/@'\"{SHELL}]*\Z"
    ),
    "flag": (
        rf"(?P<keep>(?<![\w\-])--?[\w\-]*(?i:{NAMES})[ \t]+['\"]?)(?![\-\[])"
        rf"(?:(?<='){_SQ}{{0,{LONGEST}}}|(?<=\"){_DQ}{{0,{LONGEST}}}\\?|(?<!['\"]){_BARE}*\\?)\Z"
    ),
    "user_password": (
        rf"(?P<keep>{_USER_OPENS}['\"]?{_USER}:)(?!\[REDACTED)"
        rf"{_BARE}*\\?\Z"
    ),
    "assignment": (
        rf"(?P<keep>{_NAMED}(?:\\?[\"'])?[ \t]*{GIVES}[ \t]*(?P<opened>\\?[\"'])?)"
        rf"(?!\[REDACTED){_ASSIGNED}*\\?\Z"
    ),
    "spaced_password": (
        rf"(?P<keep>\b(?i:password|passwd|passphrase)[ \t]+)(?!\[REDACTED)(?:(?!,){_BARE})*\\?\Z"
    ),
}


def compile_patterns(patterns: Mapping[str, str]) -> list[tuple[str, re.Pattern[str]]]:
    return [(name, re.compile(pattern)) for name, pattern in patterns.items()]


_COMPILED = compile_patterns(TOKEN_PATTERNS)
# One pass to rule out the common case (no credential-looking text at all) cheaply.
_ANY = re.compile("|".join(f"(?:{p.replace('?P<keep>', '')})" for p in TOKEN_PATTERNS.values()))
# And before it, a cheaper one: what every pattern holds literally (a name, a prefix, "://").
# Most text holds none, and a search for these costs a tenth of ``_ANY``'s.
_WORDS = re.compile(
    rf"(?i:{NAMES})|sk-|gh[pousr]_|github_pat_|AKIA|ASIA|xox[abposr]-|AIza|[rs]k_(?:live|test)_|glpat-"
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
