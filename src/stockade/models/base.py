"""The model interface: one abstract method, ``request``; everything else is a wrapper.

    class MyModel(Model):
        name = "mine"
        async def request(self, request: ModelRequest) -> ModelResponse: ...

Adapters raise only the ``ModelError`` family (retryable for 429/5xx/connection failures,
with ``retry_after`` from the provider's Retry-After), so a retry wrapper decides on
``exc.retryable`` alone. Wrappers subclass ``WrapperModel`` and override ``request``.
Names like ``"openai:gpt-4.1"`` resolve with ``resolve_model`` and import the provider's
SDK only then.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass

from stockade.exceptions import ConfigurationError
from stockade.models.messages import ModelRequest, ModelResponse

__all__ = ["PROVIDERS", "Model", "WrapperModel", "require_api_key", "resolve_model"]


class Model(abc.ABC):
    """An LLM that answers a conversation with text and structured tool calls."""

    name: str = "model"

    @abc.abstractmethod
    async def request(self, request: ModelRequest) -> ModelResponse:
        """One turn. Raise ``ModelError`` subclasses for provider failures."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class WrapperModel(Model):
    """Delegates to ``wrapped``; subclasses change ``request`` (retries, fallbacks, audit)."""

    def __init__(self, wrapped: Model) -> None:
        self.wrapped = wrapped
        self.name = wrapped.name

    async def request(self, request: ModelRequest) -> ModelResponse:
        return await self.wrapped.request(request)


@dataclass(frozen=True, kw_only=True)
class _Provider:
    module: str
    cls: str
    extra: str  # the pip extra that brings its SDK, "" for none


PROVIDERS: dict[str, _Provider] = {
    "openai": _Provider(module="stockade.models.openai_chat", cls="OpenAIModel", extra="openai"),
    "anthropic": _Provider(
        module="stockade.models.anthropic_messages", cls="AnthropicModel", extra="anthropic"
    ),
}


def require_api_key(variable: str, provider: str) -> str:
    key = os.environ.get(variable)
    if not key:
        raise ConfigurationError(
            f"no API key for {provider}: set {variable}, pass api_key=..., or try the keyless demo with "
            "`stockade demo` (a scripted model)"
        )
    return key


def resolve_model(spec: str | Model) -> Model:
    """``"openai:gpt-4.1"``, ``"anthropic:claude-sonnet-4-5"``, ``"scripted:turns.json"`` or a ``Model``."""
    if isinstance(spec, Model):
        return spec
    provider, sep, name = spec.partition(":")
    if not sep or not name:
        raise ConfigurationError(f"model {spec!r}: use PROVIDER:NAME, e.g. 'openai:gpt-4.1'")
    if provider == "scripted":
        from stockade.models.scripted import ScriptedModel

        return ScriptedModel.from_file(name)
    entry = PROVIDERS.get(provider)
    if entry is None:
        known = ", ".join(sorted([*PROVIDERS, "scripted"]))
        raise ConfigurationError(
            f"unknown model provider {provider!r} in {spec!r}; known: {known}. OpenAI-compatible servers "
            "(vLLM, Ollama, llama.cpp, LM Studio) use 'openai:NAME' with OPENAI_BASE_URL set"
        )
    import importlib

    # An adapter whose SDK is missing raises ConfigurationError on import, naming the extra.
    module = importlib.import_module(entry.module)
    model_cls: type[Model] = getattr(module, entry.cls)
    return model_cls(name)  # type: ignore[call-arg]  # each adapter takes the model name first
