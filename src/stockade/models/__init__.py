"""LLM adapters behind one small interface (``Model.request``).

Provider adapters (``openai_chat.OpenAIModel``, ``anthropic_messages.AnthropicModel``) import
their SDK only when used; ``resolve_model("openai:gpt-4.1")`` loads them by name. Test
doubles: ``ScriptedModel`` (replay) and ``FunctionModel`` (a function as a model).
"""

from stockade.models.base import PROVIDERS, Model, WrapperModel, resolve_model
from stockade.models.messages import (
    AssistantMessage,
    Message,
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolDefinition,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from stockade.models.pricing import DEFAULT_PRICES, Price, cost_usd
from stockade.models.scripted import FunctionModel, ScriptedModel, Turn, tool_call

__all__ = [
    "DEFAULT_PRICES",
    "PROVIDERS",
    "AssistantMessage",
    "FunctionModel",
    "Message",
    "Model",
    "ModelRequest",
    "ModelResponse",
    "Price",
    "ScriptedModel",
    "ToolCall",
    "ToolDefinition",
    "ToolResultMessage",
    "Turn",
    "Usage",
    "UserMessage",
    "WrapperModel",
    "cost_usd",
    "resolve_model",
    "tool_call",
]
