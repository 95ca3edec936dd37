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
import json
import os
from dataclasses import dataclass

from stockade.exceptions import ConfigurationError, InvalidArgument, ModelResponseInvalid
from stockade.models.messages import ModelRequest, ModelResponse, Usage

__all__ = [
    "PROVIDERS",
    "Model",
    "WrapperModel",
    "counted_usage",
    "estimate_usage",
    "require_api_key",
    "resolve_model",
]


class Model(abc.ABC):
    """An LLM that answers a conversation with text and structured tool calls."""

    name: str = "model"
    # who serves it ("openai", "anthropic", "scripted"; "" for a model of your own): the policy's
    # registry may name a provider ("openai:gpt-4.1*"), so one name served elsewhere is not it
    provider: str = ""

    @abc.abstractmethod
    async def request(self, request: ModelRequest) -> ModelResponse:
        """One turn. Raise ``ModelError`` subclasses for provider failures."""

    def credentials(self) -> tuple[str, ...]:
        """The secrets this model sends its provider (API keys): whoever writes what the model
        said or failed with registers them with its redactor (a gateway may quote them)."""
        return ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class WrapperModel(Model):
    """Delegates to ``wrapped``; subclasses change ``request`` (retries, fallbacks, audit)."""

    def __init__(self, wrapped: Model) -> None:
        self.wrapped = wrapped
        self.name = wrapped.name
        self.provider = wrapped.provider

    async def request(self, request: ModelRequest) -> ModelResponse:
        return await self.wrapped.request(request)

    def credentials(self) -> tuple[str, ...]:
        return self.wrapped.credentials()


def estimate_usage(request: ModelRequest, response: ModelResponse) -> Usage:
    """About four characters a token: enough for budgets and benchmarks to mean something."""
    sent = len(request.system) + sum(len(m.model_dump_json()) for m in request.messages)
    received = len(response.text) + sum(len(json.dumps(c.args)) + len(c.name) for c in response.tool_calls)
    return Usage(input_tokens=sent // 4 + 1, output_tokens=received // 4 + 1, requests=1)


def counted_usage(request: ModelRequest, response: ModelResponse, *, provider: str = "") -> Usage:
    """What ``response`` is counted as against the budgets: its usage, or the estimate when it
    reports none (``requests == 0``: a provider that omits usage is not free).

    Negative counts are refused (``ModelResponseInvalid``, not retryable) rather than clamped: a
    provider reporting them is broken or hostile, clamping one to 0 would still undercount, and
    a run that stops says so where a quiet correction would not."""
    usage = response.usage
    if min(usage.input_tokens, usage.output_tokens, usage.requests) < 0:
        raise ModelResponseInvalid(
            f"{provider or response.model_name or 'the model'} reported negative usage "
            f"(input_tokens={usage.input_tokens}, output_tokens={usage.output_tokens}, "
            f"requests={usage.requests}): its answer is refused, since budgets are counted from it",
            provider=provider,
        )
    return usage if usage.requests else estimate_usage(request, response)


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
    if not isinstance(spec, str):
        raise InvalidArgument(
            f"model must be a Model or a str, got {type(spec).__name__}",
            argument="model",
            fix="give PROVIDER:NAME, e.g. 'openai:gpt-4.1', or a Model",
        )
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
