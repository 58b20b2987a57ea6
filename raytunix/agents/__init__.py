"""Agents: conversation state as exact tokens, chat templates turned into per-turn tokens,
and parsers from model text to actions (one per tool-call format)."""

from __future__ import annotations

from typing import Any

from raytunix import registry
from raytunix.agents.base import ConversationAgentBase
from raytunix.agents.encoding import ConversationEncoder
from raytunix.agents.parsers import (
    TOOL_PARSERS,
    GemmaParser,
    HermesParser,
    Llama3JsonParser,
    ReActParser,
    ToolCallParser,
    make_tool_parser,
    parse_action,
    parse_answer,
    parse_answer_action,
    parse_tool_calls,
)
from raytunix.agents.text_agent import TextAgent
from raytunix.agents.tool_agent import AnswerAgent, ToolAgent

# The live registry: each agent registers itself (``@register("agent", name)``) on import.
AGENTS: dict[str, type[ConversationAgentBase]] = registry.entries("agent")


def make_agent(name: str, tokenizer: Any, **kwargs: Any) -> ConversationAgentBase:
    """Builds the agent ``name`` (a registered name such as "tool", "answer" or "text", a
    package's entry point in group ``raytunix.agents``, or ``package.module:Class``) for
    ``tokenizer``, with ``kwargs`` for its constructor (e.g. ``system_prompt``).

    Raises:
      raytunix.registry.PluginError (a ValueError): ``name`` does not resolve to a
        ``ConversationAgentBase`` subclass (the message lists the registered names).
    """
    return registry.resolve("agent", name, ConversationAgentBase)(tokenizer, **kwargs)


__all__ = [
    "AGENTS",
    "AnswerAgent",
    "ConversationAgentBase",
    "ConversationEncoder",
    "GemmaParser",
    "HermesParser",
    "Llama3JsonParser",
    "ReActParser",
    "TOOL_PARSERS",
    "TextAgent",
    "ToolAgent",
    "ToolCallParser",
    "make_agent",
    "make_tool_parser",
    "parse_action",
    "parse_answer",
    "parse_answer_action",
    "parse_tool_calls",
]
