"""Where credentials come from: the host's environment, a file, or a source you register.

A source is read once, on the host, when a sandbox's proxy starts; its value stays in that
proxy. The policy file names a source as ``"SCHEME:REST"``: ``"env:GITHUB_TOKEN"``,
``"file:/run/secrets/token"``, or a scheme of your own (``register_scheme("vault", ...)``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stockade.exceptions import ConfigurationError
from stockade.types import SecretSource

__all__ = ["EnvSecret", "FileSecret", "register_scheme", "secret_source"]


@dataclass(frozen=True)
class EnvSecret:
    """An environment variable of the host (of the process that starts the sandbox)."""

    name: str

    def read(self) -> str:
        value = os.environ.get(self.name)
        if not value:
            raise ConfigurationError(
                f"the credential's variable {self.name} is not set on this host: "
                "set it, or drop the credential from the policy"
            )
        return value


@dataclass(frozen=True)
class FileSecret:
    """A file of the host; surrounding whitespace (a trailing newline) is not part of it."""

    path: str

    def read(self) -> str:
        try:
            value = Path(self.path).read_text().strip()
        except OSError as err:
            raise ConfigurationError(
                f"cannot read the credential's file {self.path}: {err.strerror}"
            ) from None
        if not value:
            raise ConfigurationError(f"the credential's file {self.path} is empty")
        return value


_schemes: dict[str, Callable[[str], SecretSource]] = {"env": EnvSecret, "file": FileSecret}
_lock = threading.Lock()


def register_scheme(name: str, factory: Callable[[str], SecretSource]) -> None:
    """Let policy files name sources as ``"NAME:REST"``; ``factory(REST)`` makes the source."""
    with _lock:
        _schemes[name] = factory


def secret_source(text: str) -> SecretSource:
    """The source a policy file names (``"env:VAR"``, ``"file:PATH"``, ``"SCHEME:..."``)."""
    scheme, sep, rest = text.partition(":")
    with _lock:
        factory = _schemes.get(scheme)
    if not sep or factory is None or not rest:
        known = ", ".join(f'"{s}:..."' for s in sorted(_schemes))
        raise ConfigurationError(f"credential source {text!r} is not one of {known}")
    return factory(rest)
