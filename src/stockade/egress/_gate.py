"""What one sandbox's proxy decides and records, whatever the way a request came in.

``Gate`` holds the sandbox's side of every request: the policy's verdict (``Judge``), the
per-minute limits, the address a name may lead to, the redirects, the credentials' values
(read on the host at the start and again for each next user, ``renew``, and kept nowhere
else) and the ``EgressRecord`` of each request for the observer (the audit trail). The
HTTP exchange (``_http``) and the tunnels (``_tunnel``) ask it; it does no I/O but the
resolver's (and the credentials' sources, read by the proxy off its loop).
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from stockade.egress._resolve import LOOKUP_TIMEOUT_S, LookupsStuck, NotAName, Resolver
from stockade.egress._rules import Judge, Verdict
from stockade.egress._sources import fail
from stockade.egress._streams import Buffers
from stockade.types import Credential, EgressRecord, NetworkPolicy

__all__ = [
    "MAX_REDIRECT_BASE",
    "EgressObserver",
    "Forms",
    "Gate",
    "Refused",
    "Window",
    "credential_value",
    "read_secrets",
    "redacted",
]

MAX_REDIRECT_BASE = 8192
RATE_RULE = "max_requests_per_minute"

EgressObserver = Callable[[EgressRecord], None]


class Refused(Exception):
    """A request the proxy answers itself: ``status`` (403, 429, 400, 502) and why."""

    def __init__(self, status: int, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.status = status
        self.verdict = verdict


class Window:
    """What one sandbox did in the last minute: requests, and bytes both ways."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, amount: int) -> bool:
        """Count ``amount``; False once the minute's total is past the limit."""
        now = time.monotonic()
        while self.events and now - self.events[0][0] > 60.0:
            self.total -= self.events.popleft()[1]
        if self.events and now - self.events[-1][0] < 0.1:  # one entry per 100 ms at most
            t, n = self.events[-1]
            self.events[-1] = (t, n + amount)
        else:
            self.events.append((now, amount))
        self.total += amount
        return self.total <= self.limit


class Gate:
    """The decisions and records of one sandbox's proxy, on its event loop."""

    def __init__(
        self,
        policy: NetworkPolicy,
        *,
        observer: EgressObserver | None,
        resolver: Resolver,
        secrets: Mapping[str, str] | None = None,
    ) -> None:
        self.policy = policy
        self.judge = Judge(policy)
        self.observer = observer
        self.resolver = resolver
        self.lookup_timeout_s = LOOKUP_TIMEOUT_S
        self.requests = Window(policy.max_requests_per_minute)
        self.bytes = Window(policy.max_bytes_per_minute)
        self.observer_failures = 0
        self.buffers = Buffers()  # what the sandbox's connections hold in the host's memory
        # Read here (or by the caller: ``secrets``), on the host, and again at each ``renew``:
        # the values live in this object and nowhere else.
        self.secrets: dict[str, str] = read_secrets(policy) if secrets is None else dict(secrets)
        self._upstream_tls: ssl.SSLContext | None = None
        self._pending: list[EgressRecord] = []  # recorded, not yet told to the observer
        self._forms: dict[str, list[bytes]] = {}  # each credential's value as scrubbed (``secrets_for``)
        self._found: dict[str, Forms] = {}  # those forms as patterns (``forms_for``)
        self._redaction: re.Pattern[str] | None = None  # every credential's forms, any case (``redact``)
        # Past the rate one refusal is recorded, the rest counted and told as one record (when
        # a request is let through again, each minute of a flood, and at close): a sandbox
        # cannot flood the audit trail with refusals.
        self._over_rate_recorded = False
        self._over_rate = 0  # refusals past the rate not yet told
        self._over_rate_since = 0.0

    # -- decisions ---------------------------------------------------------------------------

    def count_request(self) -> None:
        """Count one request, whatever its verdict (a refused one costs a record too);
        ``Refused`` (``429``) past ``max_requests_per_minute``."""
        if self.requests.add(1):
            self._tell_over_rate(ended=True)
            return
        raise Refused(429, Verdict(
            allowed=False, rule=RATE_RULE,
            reason=f"more than {self.policy.max_requests_per_minute} requests in a minute",
        ))  # fmt: skip

    def admit(self) -> None:
        """A request begins (its first bytes came, none of it parsed yet): count it, and
        ``Refused`` (``429``) if the sandbox is past its requests or its bytes per minute.
        Checked before the head is read, so a sandbox past its rate costs the loop that all
        sandboxes share no parsing."""
        self.count_request()
        self.spend(0)

    def spend(self, amount: int) -> None:
        if not self.bytes.add(amount):
            raise Refused(429, Verdict(
                allowed=False, rule="max_bytes_per_minute",
                reason=f"more than {self.policy.max_bytes_per_minute} bytes in a minute",
            ))  # fmt: skip

    async def address(self, host: str, port: int) -> str:
        """Resolve once, check every answer, and give the address to connect to. A name
        that is none is a ``400``; one not resolved within ``lookup_timeout_s`` a ``502``
        (whatever the resolver: a host's slow DNS must not hold a request, and its
        connection, without an answer or a record)."""
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                found = await self.resolver.resolve(host, port)
        except NotAName as err:
            raise Refused(400, Verdict(allowed=False, rule="dns", reason=str(err))) from None
        except LookupsStuck as err:
            raise Refused(502, Verdict(allowed=False, rule="dns", reason=str(err))) from None
        except TimeoutError:
            raise Refused(502, Verdict(
                allowed=False, rule="dns",
                reason=f"no answer for {host} from the host's resolver in {self.lookup_timeout_s:g} s",
            )) from None  # fmt: skip
        allowed, refusal = self.judge.addresses(host, found)
        if refusal is not None:
            raise Refused(403, refusal)
        return allowed[0]

    def check_redirect(self, status: int, location: str | None, base: str) -> None:
        """Refuse a ``3xx`` whose ``Location`` (against the request's URL ``base``, its path
        cut at ``MAX_REDIRECT_BASE``) the policy would refuse: the client never sees where
        it led."""
        if not 300 <= status < 400 or location is None:
            return
        try:
            to = urllib.parse.urlsplit(urllib.parse.urljoin(base, location))
        except ValueError:  # the server's, not the code's: a 502, like an answer that is no HTTP
            raise Refused(502, Verdict(
                allowed=False, rule="redirect", reason="a redirect whose Location is no URL",
            )) from None  # fmt: skip
        to_host = (to.hostname or "").lower()
        try:
            to_port = to.port or (443 if to.scheme == "https" else 80)
        except ValueError:
            to_port = 0
        # The reasons never quote the Location: a credentialed server can put there the
        # credential it was sent, and the refusal goes to the code (and to the trail).
        if to.scheme not in ("http", "https") or not to_host:
            raise Refused(403, Verdict(
                allowed=False, rule="redirect", reason="a redirect to no http(s) URL with a host",
            ))  # fmt: skip
        verdict = self.judge.request(to_host, to_port, "CONNECT" if to.scheme == "https" else "GET")
        if not verdict.allowed:  # the judge's reason names the host: the rule says which refused
            reason = "a redirect to a host, port or method the policy refuses"
            raise Refused(403, replace(verdict, rule=f"redirect: {verdict.rule}", reason=reason))

    def secrets_for(self, credential: Credential | None) -> tuple[str | None, list[bytes]]:
        """The credential's value and what must be scrubbed from answers: it and the header
        value it is sent as (index 1), each also in the encodings a server might echo it in
        (``secret_forms``)."""
        secret = self.secrets.get(credential.name) if credential is not None else None
        if credential is None or not secret:
            return None, []
        forms = self._forms.get(credential.name)
        if forms is None:
            sent = credential_value(credential, secret)
            forms = self._forms[credential.name] = [
                secret.encode(),
                sent,
                *secret_forms(secret.encode(), sent),
            ]
        return secret, forms

    def forms_for(self, credential: Credential | None) -> Forms | None:
        """The forms ``secrets_for`` names, to find in any letter case (``Forms``)."""
        if credential is None:
            return None
        found = self._found.get(credential.name)
        if found is None:
            forms = [f for f in self.secrets_for(credential)[1] if f]
            if not forms:
                return None
            found = self._found[credential.name] = Forms.of(forms)
        return found

    def redact(self, text: str) -> str:
        """``text``, composed by the proxy (a refusal, a record), without any credential's
        value or the forms replies are scrubbed of (``secrets_for``), in any letter case: a
        message may have lowercased or quoted what a server sent, and the code reads it."""
        if not text or not self.secrets:
            return text
        pattern = self._redaction  # once: ``close`` (another thread, at a kill) drops it
        if pattern is None:
            forms = {f.decode() for c in self.policy.credentials for f in self.secrets_for(c)[1]}
            if not forms:  # values that are empty: nothing to find (an empty pattern finds everything)
                return text
            longest_first = sorted(forms, key=len, reverse=True)  # "Bearer X" before "X"
            pattern = self._redaction = re.compile("|".join(map(re.escape, longest_first)), re.IGNORECASE)
        return pattern.sub("[REDACTED]", text)

    def upstream_context(self) -> ssl.SSLContext:
        if self._upstream_tls is None:
            ctx = ssl.create_default_context()
            if self.policy.upstream_ca:
                ctx.load_verify_locations(self.policy.upstream_ca)
            ctx.set_alpn_protocols(["http/1.1"])
            self._upstream_tls = ctx
        return self._upstream_tls

    # -- records -----------------------------------------------------------------------------

    def emit(self, record: EgressRecord) -> None:
        """Record one request. The observer hears of it once the loop is done with what it
        was doing (the answer sent, the client's connection closed): an audit observer
        redacts and encodes the event on this thread, which a request need not wait for.
        Nothing is lost: ``close`` tells it everything still held (and the interpreter's
        exit closes a proxy left open, ``proxy.finish_at_exit``). Refusals past the rate
        after the first are counted, not recorded one by one (``_tell_over_rate``)."""
        if record.status == 429 and record.rule == RATE_RULE:
            if self._over_rate_recorded:
                self._over_rate += 1
                if time.monotonic() - self._over_rate_since >= 60.0:
                    self._tell_over_rate(ended=False)
                return
            self._over_rate_recorded, self._over_rate_since = True, time.monotonic()
        self._record(record)

    def _tell_over_rate(self, *, ended: bool) -> None:
        """One record for the refusals past the rate not recorded since the last one."""
        if ended:
            self._over_rate_recorded = False
        if not self._over_rate:
            return
        count, self._over_rate = self._over_rate, 0
        seconds = time.monotonic() - self._over_rate_since
        self._over_rate_since = time.monotonic()
        self._record(EgressRecord(
            host="", port=0, method="", status=429, decision="deny", rule=RATE_RULE,
            reason=f"{count} more refused past the rate in {seconds:.0f} s, not recorded one by one",
            duration_s=seconds,
        ))  # fmt: skip

    def _record(self, record: EgressRecord) -> None:
        # Nothing the proxy reports carries a secret, whatever the code asked for or a server sent.
        record = replace(
            record,
            host=self.redact(record.host),
            path=self.redact(record.path),
            sni=self.redact(record.sni),
            reason=self.redact(record.reason),
            rule=self.redact(record.rule),
        )
        if self.observer is None:
            return
        self._pending.append(record)
        if len(self._pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # not on a loop (no caller of ours): at once
                self.flush()

    def flush(self) -> None:
        """Tell the observer every record held, in order."""
        pending, self._pending = self._pending, []
        for record in pending:
            if self.observer is None:
                return
            try:
                self.observer(record)
            except Exception:  # an observer's failure must not take the sandbox's network down
                self.observer_failures += 1

    def renew(self) -> None:
        """For the sandbox's next user: the budgets per minute afresh (its refusals past the
        rate told first), the resolver's answers and lookups forgotten (else the next user
        learns by timing which names the last one asked for, and its stuck lookups hold the
        next user's slots), and the credentials' values dropped: the proxy reads them again
        (``_sources.secrets_in_time``, off this loop) and gives them with ``use_secrets``, so a value
        rotated since the sandbox started is not sent for the next user."""
        self._tell_over_rate(ended=True)
        self.flush()
        self.requests = Window(self.policy.max_requests_per_minute)
        self.bytes = Window(self.policy.max_bytes_per_minute)
        self._over_rate_recorded = False
        forget = getattr(self.resolver, "forget", None)  # a resolver of the caller's may have none
        if callable(forget):
            forget()
        self.use_secrets({})

    def use_secrets(self, secrets: dict[str, str]) -> None:
        """Send these values from now on (``read_secrets``); the forms scrubbed follow them."""
        self.secrets = dict(secrets)
        self._forms.clear()
        self._found.clear()  # else answers would be scrubbed of the old value, not this one
        self._redaction = None

    def close(self) -> None:
        """Tell the observer what is held, then drop the credentials."""
        self._tell_over_rate(ended=True)
        self.flush()
        self.secrets.clear()
        self._forms.clear()
        self._found.clear()
        self._redaction = None


def read_secrets(policy: NetworkPolicy) -> dict[str, str]:
    """Each credential's value, from its source (on the host; it may block, a vault asked).
    A source's own failure that is no ``StockadeError`` is a ``SandboxStartError`` (it may
    be passing: a vault down), its message not quoted (it may hold what was read)."""
    secrets: dict[str, str] = {}
    for credential in policy.credentials:
        try:
            secrets[credential.name] = credential.source.read()
        except Exception as err:
            fail(credential, err)
    return secrets


@dataclass(frozen=True)
class Forms:
    """A credential's forms (``Gate.secrets_for``), found in any letter case: a server may
    echo a value upper- or lowercased (a case-sensitive scrub let ``bearer tok-...`` through),
    and h11 gives header names lowercased. Kept lowercased, and looked for in the text
    lowercased (ASCII only: every byte stays where it was), each form by ``bytes.find``:
    about what one ``bytes.replace`` a form cost (0.4-0.6 ms per 256 KiB and 14 forms), where
    one pattern of them all with ``re.IGNORECASE`` took 16-21 ms."""

    lowered: tuple[bytes, ...]  # longest first

    @classmethod
    def of(cls, forms: Iterable[bytes]) -> Forms:
        return cls(tuple(sorted({c.lower() for f in forms if f for c in _cases(f)}, key=len, reverse=True)))

    @property
    def longest(self) -> int:
        return len(self.lowered[0]) if self.lowered else 0

    def holds(self, data: bytes) -> bool:
        lowered = data.lower()
        return any(form in lowered for form in self.lowered)

    def runs(self, data: bytes) -> list[tuple[int, int]]:
        """Where ``data`` holds any form: (start, end) of each run of bytes that forms cover,
        in order, forms that overlap ("Bearer X" and "X") one run."""
        lowered = data.lower()
        found: list[tuple[int, int]] = []
        for form in self.lowered:
            at = lowered.find(form)
            while at >= 0:
                found.append((at, at + len(form)))
                # on past the match, as a regex's scan goes: a form that overlaps itself
                # ("aaaa" in a run of a's) found at every byte made a list of millions
                at = lowered.find(form, at + len(form))
        runs: list[tuple[int, int]] = []
        for start, end in sorted(found):
            if runs and start <= runs[-1][1]:  # overlapping or touching: one run
                runs[-1] = (runs[-1][0], max(end, runs[-1][1]))
            else:
                runs.append((start, end))
        return runs

    def scrub(self, data: bytes) -> bytes:
        return redacted(data, self.runs(data))


def _cases(form: bytes) -> set[bytes]:
    """``form``, and where it is UTF-8 text beyond ASCII its upper, lower and casefolded
    spellings: the scan lowers ASCII letters only (every byte stays where it was), and a
    server that echoed ``tok-Grüße`` upper-cased sent ``TOK-GRÜSSE``."""
    try:
        text = form.decode()
    except UnicodeDecodeError:
        return {form}
    if text.isascii():
        return {form}
    return {form, *(spelled.encode() for spelled in (text.upper(), text.lower(), text.casefold()))}


def redacted(data: bytes, runs: list[tuple[int, int]]) -> bytes:
    """``data`` with each of ``runs`` (``Forms.runs``) replaced by ``[REDACTED]``."""
    if not runs:
        return data
    parts, at = [], 0
    for start, end in runs:
        parts += [data[at:start], b"[REDACTED]"]
        at = end
    parts.append(data[at:])
    return b"".join(parts)


def credential_value(credential: Credential, secret: str) -> bytes:
    """The header value the credential is sent as."""
    if credential.style == "basic":
        pair = f"{credential.username}:{secret}".encode()
        return b"Basic " + base64.b64encode(pair)
    if credential.style == "bearer":
        return b"Bearer " + secret.encode()
    return secret.encode()


MIN_FORM = 8  # a shorter encoded form would redact bytes that merely look like it


def secret_forms(*values: bytes) -> list[bytes]:
    """The encodings of ``values`` a server that reflects request headers commonly applies:
    hex (both cases), percent-encoding (as ``quote`` writes it, and every byte escaped, both
    cases) and base64, standard and URL-safe. Base64 of a longer text holding the value
    (an echo of the whole request head) encodes it at one of three offsets: for each, the
    characters that depend on the value's bytes alone. Others (a JSON escape, a part of
    the value, a transform of the server's own) are not found: see docs/architecture.md."""
    forms: list[bytes] = []
    for value in values:
        forms += [value.hex().encode(), value.hex().upper().encode()]
        forms += [urllib.parse.quote(value, safe="").encode(), urllib.parse.quote_plus(value).encode()]
        forms += ["".join(f"%{b:02X}" for b in value).encode(), "".join(f"%{b:02x}" for b in value).encode()]
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            for shift in range(3):
                text = encode(b"\0" * shift + value)
                first, last = -(-8 * shift // 6), 8 * (shift + len(value)) // 6
                forms.append(text[first:last])  # the characters whose 6 bits are all the value's
    unique = dict.fromkeys(f for f in forms if len(f) >= MIN_FORM and f not in values)
    return list(unique)
